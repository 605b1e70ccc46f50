"""How much memory does ZeRO-1 save: optimizer-state bytes per device over device counts, the largest MLP under a cap?

1. **Optimizer state per device.** An MLP (256 -> W -> W -> W -> 10, AdamW) is
   initialised on N = 1, 2, 4, 8 simulated devices with
   ``DataParallel(shard_optimizer=True)`` and with the replicated engine; the
   bytes of the optimizer state on each device are summed from the live
   buffers (``jddp.engine.zero.state_bytes``: every shard of every leaf).
2. **Largest MLP under a cap.** For each engine on 8 devices, the widest such
   MLP (W a multiple of 64) whose compiled training step fits in ``--cap-mib``
   per device, by XLA's own account of the program
   (``compiled.memory_analysis()``: arguments + outputs - donated aliases +
   temporaries, per device), found by bisection on abstract inputs (nothing
   allocated); then each engine trains its widest MLP for a few steps on
   random data, to show that it runs and the loss falls, and the live bytes of
   its state per device are read back.

    python -m benchmarks zero
    python -m benchmarks zero --cap-mib 64 --width 2048
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

QUICK: dict[str, Any] = {"width": 128, "cap_mib": 2.0, "steps": 2}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024, help="hidden width W for the bytes-per-device table")
    p.add_argument("--cap-mib", type=float, default=32.0, help="per-device memory cap for the largest MLP")
    p.add_argument("--batch", type=int, default=64, help="global batch size")
    p.add_argument("--steps", type=int, default=5, help="training steps at the largest width")
    return p


def bench(args: argparse.Namespace) -> Any:
    os.environ.setdefault("JDDP_LOCAL_DEVICES", "8")
    import jddp

    jddp.initialize(verbose=False)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jddp.engine import zero

    def mlp(width: int) -> dict:
        sizes = [256, width, width, width, 10]
        return {
            f"l{i}": {"w": jax.ShapeDtypeStruct((a, b), jnp.float32), "b": jax.ShapeDtypeStruct((b,), jnp.float32)}
            for i, (a, b) in enumerate(itertools.pairwise(sizes))
        }

    def real(shapes: dict, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        return jax.tree.map(
            lambda s: (rng.normal(size=s.shape) / np.sqrt(s.shape[0])).astype(np.float32) if len(s.shape) == 2
            else np.zeros(s.shape, np.float32), shapes,
        )  # fmt: skip

    def loss_fn(params, model_state, batch, rng):
        x = batch["x"]
        for i in range(len(params)):
            x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
            x = jax.nn.relu(x) if i < len(params) - 1 else x
        loss = optax.softmax_cross_entropy_with_integer_labels(x, batch["y"])
        return jddp.masked_mean(loss, batch.get("mask")), (model_state, {})

    def engine(shard: bool, devices: int):
        mesh = jddp.data_mesh(jax.devices()[:devices])
        return jddp.DataParallel(loss_fn, optax.adamw(1e-3, weight_decay=0.01), mesh=mesh, shard_optimizer=shard)

    def batch(seed: int) -> dict:
        rng = np.random.default_rng(100 + seed)
        return {"x": rng.normal(size=(args.batch, 256)).astype(np.float32),
                "y": rng.integers(0, 10, args.batch).astype(np.int32)}  # fmt: skip

    # 1. Optimizer-state bytes per device, from the live buffers.
    print(f"1. AdamW state bytes per device, MLP 256-{args.width}-{args.width}-{args.width}-10 (live buffers)")
    print(f"{'devices':>7}  {'replicated':>12}  {'shard_optimizer':>15}  {'ratio to 1 device':>17}  {'x devices':>9}")
    params = real(mlp(args.width))
    base, table = None, {}
    for n in (1, 2, 4, 8):
        row = []
        for shard in (False, True):
            per_device = zero.state_bytes(engine(shard, n).init(params).opt_state)
            assert len(set(per_device.values())) == 1, per_device  # the same on every device
            row.append(next(iter(per_device.values())))
        base = base or row[1]
        table[n] = {"replicated": row[0], "shard_optimizer": row[1]}
        print(f"{n:>7}  {row[0]:>12,}  {row[1]:>15,}  {row[1] / base:>17.4f}  {row[1] * n / base:>9.4f}")

    # 2. The widest MLP whose step fits the cap on 8 devices.
    cap = args.cap_mib * 2**20

    def abstract_state(dp, shapes):
        """The state ``dp.init`` would build for parameters of ``shapes``, as shapes and shardings only."""
        from jddp.runtime.state import TrainState

        rep = jddp.runtime.replicated(dp.mesh)
        sds = lambda x, sharding=rep: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        layout = zero.opt_layouts(dp.optimizer, shapes, dp.num_devices) if dp.options.shard_optimizer else None
        init = dp.optimizer.init if layout is None else lambda p: zero.pad(layout, dp.optimizer.init(p))
        opt = jax.eval_shape(init, shapes)
        if layout is None:
            opt = jax.tree.map(sds, opt)
        else:
            opt = jax.tree.map(sds, opt, zero.shardings(layout, jax.tree.structure(opt), dp.mesh))
        step, key = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.uint32)
        return TrainState(sds(step), jax.tree.map(sds, shapes), opt, {}, sds(key), layout)

    def step_bytes(shard: bool, width: int) -> int:
        """XLA's per-device memory of the compiled step: arguments + outputs - donated aliases + temporaries."""
        dp = engine(shard, 8)
        state = abstract_state(dp, mlp(width))
        example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch(0))
        stats = dp._program(state).lower(*dp._args(state, example)).compile().memory_analysis()
        return (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                + stats.temp_size_in_bytes)  # fmt: skip

    print(f"\n2. Widest MLP 256-W-W-W-10 whose AdamW step fits {args.cap_mib:g} MiB per device, 8 devices")
    print(f"{'engine':>15}  {'W':>6}  {'parameters':>11}  {'step MiB':>8}  {'W+64 MiB':>8}  "
          f"{'loss first -> last':>20}  {'state MiB/device':>16}")  # fmt: skip
    widest = {}
    for shard in (False, True):
        lo, hi = 64, 64
        while step_bytes(shard, hi) <= cap:
            lo, hi = hi, hi * 2
        while hi - lo > 64:
            mid = (lo + hi) // 2 // 64 * 64
            lo, hi = (mid, hi) if step_bytes(shard, mid) <= cap else (lo, mid)
        widest[shard] = lo
        dp = engine(shard, 8)
        state = dp.init(real(mlp(lo)), rng=0)
        losses = []
        start = time.perf_counter()
        for i in range(args.steps):
            state, metrics = dp.step(state, batch(i % 2))
            losses.append(metrics["loss"])
        live = max(zero.state_bytes(state).values())
        count = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(mlp(lo)))
        name = "shard_optimizer" if shard else "replicated"
        print(f"{name:>15}  {lo:>6}  {count:>11,}  {step_bytes(shard, lo) / 2**20:>8.2f}  "
              f"{step_bytes(shard, lo + 64) / 2**20:>8.2f}  {losses[0]:>9.4f} -> {losses[-1]:<8.4f}  "
              f"{live / 2**20:>16.2f}   ({time.perf_counter() - start:.1f} s)")  # fmt: skip
    ratio = widest[True] / widest[False]
    print(f"\nwidth x{ratio:.2f}, parameters x{ratio**2:.2f} (the three W x W layers dominate)")
    widest_by = {"shard_optimizer" if shard else "replicated": w for shard, w in widest.items()}
    return {"opt_state_bytes_per_device": table, "widest": widest_by, "width_ratio": ratio}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
