"""How much slower is jddp's step than hand-written jit(shard_map) steps of the same math, and a single device's?

All variants run the same model (the MNIST-1D MLP), optimizer (AdamW) and
global batches, interleaved round by round (order alternating) in one process
so that machine noise hits them alike. Prints the median time per step, the
10th-90th percentile range and the ratios. Pairs of the same math:

* ``jddp`` (default: exact count-weighted mean, skips non-finite updates,
  reports the gradient norm, counts steps) against ``hand-written same``, the
  same math written out by hand in one ``jit(shard_map)``;
* ``jddp ignore`` (``nonfinite="ignore"``, as PyTorch DDP) against
  ``hand-written`` (value_and_grad, pmean, optax update).

    python -m benchmarks step_overhead --devices 8 --rounds 15 --steps 20
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

QUICK: dict[str, Any] = {"devices": 2, "rounds": 2, "steps": 2, "hidden": 32}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds per variant")
    p.add_argument("--steps", type=int, default=20, help="steps per round")
    p.add_argument("--global-batch-size", type=int, default=256, help="examples per step")
    p.add_argument("--hidden", type=int, default=256, help="MLP width")
    return p


def bench(args: argparse.Namespace) -> Any:
    import jddp

    jddp.simulate_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from jddp.benchmark import models

    rng = np.random.default_rng(0)
    sizes = [40, args.hidden, args.hidden, 10]
    params = {f"l{i}": {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}
              for i, (a, b) in enumerate(itertools.pairwise(sizes))}  # fmt: skip
    batches = [
        {"x": rng.normal(size=(args.global_batch_size, 40)).astype(np.float32),
         "y": rng.integers(0, 10, args.global_batch_size).astype(np.int32)}
        for _ in range(args.steps)
    ]  # fmt: skip
    optimizer = optax.adamw(1e-3)

    def forward(params, x):
        for i in range(len(sizes) - 1):
            x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"][None, :]
            x = jax.nn.relu(x) if i < len(sizes) - 2 else x
        return x

    def mean_loss(params, batch):
        return optax.softmax_cross_entropy_with_integer_labels(forward(params, batch["x"]), batch["y"]).mean()

    # jddp
    def loss_fn(params, model_state, batch, rng):
        return jddp.masked_mean(
            optax.softmax_cross_entropy_with_integer_labels(forward(params, batch["x"]), batch["y"]), batch.get("mask")
        ), (model_state, {})

    mesh = jddp.data_mesh()
    dp = jddp.DataParallel(loss_fn, optimizer, mesh=mesh)
    dp_ignore = jddp.DataParallel(loss_fn, optimizer, mesh=mesh, nonfinite="ignore")
    dp_unfused = jddp.DataParallel(loss_fn, optimizer, mesh=mesh, fuse_allreduce=False)  # one buffer per leaf
    dp_fused = jddp.DataParallel(loss_fn, optimizer, mesh=mesh, fuse_allreduce=True)  # packed (jddp.engine.fused)

    def local_step_same_math(params, opt_state, batch):
        # jddp's math written out: loss total weighted by the local count, one
        # psum of gradient sums and counts, divide once, guard, step counter.
        # Standalone on purpose: a different computation from the reference
        # step (psum of sums and counts, gradient norm, non-finite guard), the
        # hand-written twin of jddp's default step, not of a plain pmean.
        (params, step) = params
        count = jnp.float32(batch["y"].shape[0])
        varying = jax.tree.map(lambda p: lax.pcast(p, "data", to="varying"), params)
        total, grads = jax.value_and_grad(lambda p: mean_loss(p, batch) * count)(varying)
        total, count, grads = lax.psum((total, lax.pcast(count, "data", to="varying"), grads), "data")
        loss, norm = total / count, optax.tree.norm(grads) / count

        def update(args):
            grads, params, opt_state = args
            grads = jax.tree.map(lambda g: g / count, grads)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        ok = jnp.isfinite(loss) & jnp.isfinite(norm)
        params, opt_state = lax.cond(ok, update, lambda a: (a[1], a[2]), (grads, params, opt_state))
        return (params, step + 1), opt_state, jnp.stack([loss, norm, count, (~ok).astype(jnp.float32)])

    rep, bsh = jddp.replicated(mesh), jddp.batch_sharding(mesh)

    def compile_hand(fn):
        return jax.jit(
            jax.shard_map(fn, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P()),
            in_shardings=(rep, rep, bsh), out_shardings=rep, donate_argnums=(0, 1),
        )  # fmt: skip

    # Hand-written: what a careful JAX user writes with shard_map.
    hand, hand_same = models.reference_step(mean_loss, optimizer, mesh), compile_hand(local_step_same_math)

    # One device, whole batch.
    def single_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(mean_loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    single = jax.jit(single_step, donate_argnums=(0, 1))

    dev_batches = [jax.device_put(b, bsh) for b in batches]
    one_batches = [jax.device_put(b, jax.devices()[0]) for b in batches]
    states = {"jddp": dp.init(params), "jddp ignore": dp_ignore.init(params), "jddp unfused": dp_unfused.init(params),
              "jddp fused": dp_fused.init(params)}  # fmt: skip
    hand_states = {}
    for name in ("hand-written", "hand-written same"):
        h_params = jax.tree.map(lambda x: jax.device_put(np.array(x), rep), params)
        hand_states[name] = (h_params, jax.jit(optimizer.init, out_shardings=rep)(h_params))
    hand_states["hand-written same"] = ((hand_states["hand-written same"][0], jax.device_put(np.int32(0), rep)),
                                        hand_states["hand-written same"][1])  # fmt: skip
    s_params = jax.tree.map(lambda x: jax.device_put(np.array(x), jax.devices()[0]), params)
    s_opt = optimizer.init(s_params)

    def run_jddp(name, dp):
        state = states[name]
        for b in dev_batches:
            state, m = dp.step(state, b)
        jax.block_until_ready(m)
        states[name] = state

    def run_hand(name, step):
        h_params, h_opt = hand_states[name]
        pending = None
        for b in dev_batches:
            h_params, h_opt, out = step(h_params, h_opt, b)
            if pending is not None:  # at most 2 in flight, as jddp (XLA:CPU deadlocks past ~100)
                pending.block_until_ready()
            pending = out
        pending.block_until_ready()
        hand_states[name] = (h_params, h_opt)

    def run_single():
        nonlocal s_params, s_opt
        for b in one_batches:
            s_params, s_opt, loss = single(s_params, s_opt, b)
        loss.block_until_ready()

    variants = {
        "jddp": lambda: run_jddp("jddp", dp),
        "hand-written same": lambda: run_hand("hand-written same", hand_same),
        "jddp ignore": lambda: run_jddp("jddp ignore", dp_ignore),
        "jddp unfused": lambda: run_jddp("jddp unfused", dp_unfused),
        "jddp fused": lambda: run_jddp("jddp fused", dp_fused),
        "hand-written": lambda: run_hand("hand-written", hand),
        "single-device": run_single,
    }
    for run in variants.values():  # compile and warm up
        run()
        run()
    # alternate the order so no variant always runs first
    arms = {name: harness.timed(run, per=args.steps) for name, run in variants.items()}
    times: dict[str, list[float]] = harness.interleave(arms, args.rounds, harness.abba)

    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"MNIST-1D MLP {sizes}, AdamW, global batch {args.global_batch_size}, {args.devices} simulated devices, "
          f"{args.rounds} rounds x {args.steps} steps, interleaved")  # fmt: skip
    print(f"{'variant':<20}{'median ms/step':>16}{'p10':>9}{'p90':>9}{'vs hand':>9}")
    for k, v in times.items():
        p10, p90 = np.percentile(v, [10, 90])
        print(f"{k:<20}{med[k]:>16.3f}{p10:>9.3f}{p90:>9.3f}{med[k] / med['hand-written']:>9.3f}")
    ratios = {
        "jddp / hand-written same": med["jddp"] / med["hand-written same"],
        "jddp ignore / hand-written": med["jddp ignore"] / med["hand-written"],
        "jddp / jddp unfused": med["jddp"] / med["jddp unfused"],
        "jddp fused / jddp unfused": med["jddp fused"] / med["jddp unfused"],
        "cost of exact weighting + guard (hand-written same / hand-written)": med["hand-written same"]
        / med["hand-written"],
    }
    for k, v in ratios.items():
        print(f"{k} = {v:.3f}")
    print("target: jddp / hand-written of the same math <= 1.03")
    return {**ratios, **med}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
