"""Does jddp run on this machine's devices as shown on CPU: equal to plain jit, as fast as a hand-written step?

One command for the day an accelerator is at hand (and, at ``--quick``, a smoke run on simulated CPU devices in the
suite). On the devices present (``--devices N`` simulates N CPU devices instead), for the MLP and the CNN of
``jddp bench`` and the LM example's Transformer (``benchmarks/lm.py``):

- **equal**: ``--steps`` SGD steps of jddp's ``DataParallel`` against the same steps of a plain ``jax.jit`` step on
  one device over the whole global batch (the LM in float32 compute here, as bfloat16 rounds each device's partial
  sums differently): the largest parameter difference, to be within ``--tolerance`` (1e-6);
- **speed**: jddp's step time over a hand-written ``jit(shard_map)`` step of the same math
  (``jddp.benchmark.models.reference_step``: one ``pmean``), timed in interleaved rounds (the harness's pairing),
  medians and the median of the rounds' ratios with its bootstrap interval;
- **memory**: bytes per device of the replicated engine and of ZeRO-1 (``shard_optimizer=True``), from the
  devices' ``memory_stats()`` where the backend keeps them (GPU, TPU) and from the compiled step's
  ``memory_analysis()`` everywhere;
- **snapshot**: the step time with an in-memory snapshot of the state every step over the step alone, interleaved
  (on an accelerator the snapshot's device-to-host copy is part of it);
- **bench**: ``jddp bench --model mlp`` at the device counts present (one process), its table as printed.

    python -m benchmarks accelerator                      # the devices present; under 8 minutes on one GPU
    python -m benchmarks accelerator --quick --devices 8  # a smoke run on 8 simulated CPU devices

Prints one table and, with ``--json``, the harness's record.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

# --quick: the LM at one layer over 16 tokens (its compile is most of a quick run's time; the claims are the same)
QUICK: dict[str, Any] = {
    "steps": 3, "rounds": 3, "timed_steps": 2, "batch_per_device": 8, "bench": False, "lm_layers": 1, "lm_seq_len": 16
}  # fmt: skip
MODELS = ("mlp", "cnn", "lm")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=harness.question(__doc__))
    p.add_argument("--devices", type=int, default=None, help="simulate N CPU devices (default: the devices present)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, of mlp, cnn, lm (default: all)")
    p.add_argument("--steps", type=int, default=10, help="SGD steps compared with plain jit")
    p.add_argument("--tolerance", type=float, default=1e-6, help="largest parameter difference allowed")
    p.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds per comparison")
    p.add_argument("--timed-steps", type=int, default=20, help="steps per timing round")
    p.add_argument("--batch-per-device", type=int, default=64, help="examples per device (the LM: 4 times fewer)")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="leave out jddp bench")
    p.add_argument("--lm-layers", type=int, default=2, help="the LM's Transformer blocks (benchmarks/lm.py: 2)")
    p.add_argument("--lm-seq-len", type=int, default=64, help="the LM's tokens per example (benchmarks/lm.py: 64)")
    return p


def model_of(name: str, mesh, args, *, float32: bool = False):
    """``(loss_fn, params, model_state, batch)`` of a model in jddp's contract, the batch global and on the host
    (``args.batch_per_device`` examples per device; the LM's size from ``args.lm_layers`` and ``args.lm_seq_len``)."""
    import jax.numpy as jnp

    import jddp
    from jddp.benchmark import models

    n, batch_per_device = mesh.size, args.batch_per_device
    if name in ("mlp", "cnn"):

        def loss_fn(params, model_state, batch, rng):
            return models.mean_loss(name, params, batch), (model_state, {})

        return loss_fn, models.init_params(name), {}, models.synthetic_batches(1, n * batch_per_device)[0]
    from flax import nnx

    from benchmarks import lm

    config = lm.Config(
        global_batch_size=max(n, n * batch_per_device // 4), layers=args.lm_layers, seq_len=args.lm_seq_len
    )
    model = lm.Transformer(config, dtype=jnp.float32 if float32 else jnp.bfloat16, rngs=nnx.Rngs(config.seed))
    graphdef, params, model_state = jddp.models.nnx_split(model)
    batch = {k: v[: config.global_batch_size] for k, v in lm_windows(config.seq_len).items()}
    return jddp.models.nnx_loss(graphdef, lm.loss), params, model_state, batch


@functools.cache
def lm_windows(seq_len: int) -> dict[str, Any]:
    """The LM's training windows (``benchmarks/lm.py``: the standard library cut, seconds), cut once per run."""
    from benchmarks import lm

    return lm.train_windows(lm.Config(seq_len=seq_len))


def mean_of(loss) -> Any:
    """A loss in jddp's contract as the mean it stands for (a ``Weighted`` pair's quotient)."""
    import jddp

    return loss.total / loss.weight if isinstance(loss, jddp.Weighted) else loss


def equality(name: str, mesh, args) -> float:
    """The largest difference between jddp's parameters and plain jit's after ``args.steps`` SGD steps."""
    import jax
    import numpy as np
    import optax

    import jddp

    loss_fn, params, model_state, batch = model_of(name, mesh, args, float32=True)
    optimizer = optax.sgd(0.1)
    dp = jddp.DataParallel(loss_fn, optimizer, mesh=mesh)
    state = dp.init(jax.tree.map(np.array, params), model_state)
    for _ in range(args.steps):
        state, _ = dp.step(state, batch)
    mine = jddp.models.to_host(state).params
    one = jax.devices()[0]
    key = jax.random.key(0)

    @jax.jit
    def plain(p, opt_state, b):
        grads = jax.grad(lambda q: mean_of(loss_fn(q, model_state, b, key)[0]))(p)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    p = jax.device_put(jax.tree.map(np.array, params), one)
    opt_state, b = optimizer.init(p), jax.device_put(batch, one)
    for _ in range(args.steps):
        p, opt_state = plain(p, opt_state, b)
    pairs = zip(jax.tree.leaves(mine), jax.tree.leaves(jax.device_get(p)), strict=True)
    return float(max(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))) for a, b in pairs))


def speed_and_memory(name: str, mesh, args) -> dict[str, Any]:
    """jddp's step over the hand-written one (interleaved), bytes per device replicated and ZeRO-1, and the
    snapshot's cost on the step."""
    import jax
    import numpy as np
    import optax

    import jddp
    from jddp.benchmark import models

    loss_fn, params, model_state, batch = model_of(name, mesh, args)
    optimizer = optax.adam(1e-3)
    sharded = jax.device_put(batch, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    engines, states = {}, {}
    for arm, zero in (("replicated", False), ("zero1", True)):
        engines[arm] = jddp.DataParallel(loss_fn, optimizer, mesh=mesh, shard_optimizer=zero)
        states[arm] = engines[arm].init(jax.tree.map(np.array, params), model_state)
    hand = models.reference_step(
        lambda p, b: mean_of(loss_fn(p, model_state, b, jax.random.key(0))[0]), optimizer, mesh
    )
    rep = jddp.replicated(mesh)
    hand_state = [jax.device_put(jax.tree.map(np.array, params), rep)]
    hand_state.append(jax.jit(optimizer.init, out_shardings=rep)(hand_state[0]))

    def jddp_steps(arm: str):
        def run():
            for _ in range(args.timed_steps):
                states[arm], metrics = engines[arm].step(states[arm], sharded)
            float(metrics["loss"])

        return run

    def hand_steps():
        for _ in range(args.timed_steps):
            hand_state[0], hand_state[1], loss = hand(hand_state[0], hand_state[1], sharded)
        float(loss)

    memory = "/dev/shm" if os.path.isdir("/dev/shm") else None  # where jddp launch keeps its snapshots
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=memory) as snapshots:
        os.environ.setdefault("JDDP_SNAPSHOT_DIR", snapshots)
        ckpt = jddp.Checkpointer(f"{tmp}/ckpt", save_every=10**9, snapshots=True, snapshot_every=1)

        def snapshot_steps():
            for _ in range(args.timed_steps):
                states["replicated"], metrics = engines["replicated"].step(states["replicated"], sharded)
                ckpt.maybe_save(states["replicated"])
            float(metrics["loss"])

        arms = {"jddp": jddp_steps("replicated"), "hand": hand_steps, "snapshot": snapshot_steps}
        for fn in arms.values():  # compile, and a first snapshot
            fn()
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _, arm in harness.permuted(list(arms), args.rounds):
            start = time.perf_counter()
            arms[arm]()
            times[arm].append((time.perf_counter() - start) / args.timed_steps)
        ckpt.close()
    out = {
        "step_s": {arm: float(np.median(t)) for arm, t in times.items()},
        "jddp_over_hand": harness.compare(times["jddp"], times["hand"]),
        "snapshot_over_step": harness.compare(times["snapshot"], times["jddp"]),
        "bytes_per_device": {},
    }
    for arm in ("replicated", "zero1"):
        analysis = engines[arm].compile(states[arm], sharded).memory_analysis()
        compiled = None if analysis is None else int(
            analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
            - analysis.alias_size_in_bytes
        )  # fmt: skip
        live = [d.memory_stats() for d in mesh.devices.flat]
        in_use = [s.get("bytes_in_use") for s in live if s] or None
        out["bytes_per_device"][arm] = {"compiled": compiled, "in_use": max(in_use) if in_use else None}
    return out


def bench_table(devices: int) -> str:
    """``jddp bench --model mlp`` at the device counts present, one process, as it prints."""
    counts = ",".join(str(c) for c in (1, 2, 4, 8, 16, 32) if c <= devices) or "1"
    out = tempfile.mkdtemp() + "/bench"
    command = [sys.executable, "-m", "jddp.cli.main", "bench", "--model", "mlp", "--devices", counts,
               "--processes", "1", "--steps", "10", "--rounds", "3", "--output", out]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    return done.stdout if done.returncode == 0 else f"jddp bench failed ({done.returncode}): {done.stderr[-2000:]}"


def megabytes(memory: dict[str, int | None]) -> str:
    """A device's bytes in use (where the backend counts them), else the compiled step's, in MiB."""
    value = memory["in_use"] or memory["compiled"]
    return "?" if value is None else f"{value / 2**20:.2f}"


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import jddp

    if args.devices is not None:
        jddp.simulate_cpu_devices(args.devices)
    import jax

    mesh = jddp.data_mesh()
    results: dict[str, Any] = {"platform": jax.default_backend(), "devices": jax.device_count(), "models": {}}
    rows = [("model", "max |jddp - jit|", "jddp/hand", "95% interval", "snapshot/step", "MB/dev repl", "MB/dev ZeRO-1")]
    for name in args.models.split(","):
        diff = equality(name, mesh, args)
        found = speed_and_memory(name, mesh, args)
        found["max_diff_vs_plain_jit"] = diff
        found["equal"] = diff <= args.tolerance
        results["models"][name] = found
        ratio, mem = found["jddp_over_hand"], found["bytes_per_device"]
        rows.append((
            name, f"{diff:.1e}{'' if found['equal'] else ' (> tolerance)'}", f"{ratio['median_pair_ratio']:.3f}",
            f"[{ratio['ci95'][0]:.3f}, {ratio['ci95'][1]:.3f}]",
            f"{found['snapshot_over_step']['median_pair_ratio']:.3f}", megabytes(mem["replicated"]),
            megabytes(mem["zero1"]),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"jddp on {results['devices']} {results['platform']} device(s), {args.steps} SGD steps compared, "
          f"{args.rounds} rounds of {args.timed_steps} steps timed")  # fmt: skip
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    if args.bench:
        results["bench"] = bench_table(results["devices"])
        print(results["bench"])
    if not all(m["equal"] for m in results["models"].values()):
        raise SystemExit(f"jddp differs from plain jit by more than {args.tolerance} (the table above)")
    return results


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), measure, argv, QUICK)


if __name__ == "__main__":
    main()
