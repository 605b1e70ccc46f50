"""How long does an async checkpoint block the training loop, against a synchronous save, and a restore take?

How long an async checkpoint blocks the training loop, against a synchronous save; and restore time.

    python -m benchmarks checkpoint_stall [--sizes-mb 16,64,256] [--repeats 5] [--devices 2]

For each state size (float32 parameters in four leaves, SGD so the optimizer
state is empty), two ``jddp.Checkpointer`` stay open as in a training loop, one
with ``async_save=True`` and one with ``async_save=False``. Each round runs one
training step (untimed, waited for), then saves with both, in alternating order
so that machine noise hits both:

* async: the time ``save()`` blocks the caller; the write continues in the
  background and is waited for, untimed, before the round goes on;
* sync: the time until the checkpoint is published;
* restore: ``restore_or_init`` of the newest synchronous checkpoint into a fresh
  state, digests checked, with a fresh ``Checkpointer``.

Round 0 warms up (compiles, starts Orbax) and is not counted. It prints medians
and the ratio blocked/sync per size. Target: at most 10% from 64 MB up.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

MODES = ("async", "sync")

QUICK: dict[str, Any] = {"sizes_mb": "1", "repeats": 1}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--directory", default=None, help="where to write (default: a temporary directory)")
    return parser


def bench(args: argparse.Namespace) -> Any:

    import jddp

    jddp.simulate_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    root = args.directory or tempfile.mkdtemp(prefix="jddp-ckpt-bench-")
    print(f"jax {jax.__version__}, {jax.device_count()} devices, writing under {root}")
    print(f"{'state MB':>8} {'async blocked ms':>17} {'sync save ms':>13} {'blocked/sync':>13} {'restore ms':>11}")
    batch = {"x": np.ones((8 * args.devices, 2), np.float32)}
    results = {}
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        n = size_mb * 2**20 // 4 // 4  # four leaves
        params = {f"w{i}": np.random.default_rng(i).normal(size=(n,)).astype(np.float32) for i in range(4)}
        dp = jddp.DataParallel(
            lambda p, s, b, r: (jnp.mean(b["x"]) * p["w0"][0], (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh()
        )
        state = dp.init(params)
        ckpts = {mode: jddp.Checkpointer(f"{root}/{size_mb}-{mode}", async_save=mode == "async") for mode in MODES}
        times: dict[str, list[float]] = {"async": [], "sync": [], "restore": []}
        for round_ in range(args.repeats + 1):
            state, _ = dp.step(state, batch)
            jax.block_until_ready(state)
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                start = time.perf_counter()
                ckpts[mode].save(state)
                elapsed = time.perf_counter() - start
                ckpts[mode].wait()
                if round_:
                    times[mode].append(elapsed)
            with jddp.Checkpointer(f"{root}/{size_mb}-sync", read_only=True) as reader:  # the writer is open
                fresh = dp.init(jax.tree.map(np.zeros_like, params))
                start = time.perf_counter()
                back = reader.restore_or_init(fresh)
                jax.block_until_ready(back)
                if round_:
                    times["restore"].append(time.perf_counter() - start)
                assert int(back.step) == round_ + 1
            del back, fresh
        for ckpt in ckpts.values():
            ckpt.close()
        shutil.rmtree(f"{root}/{size_mb}-async"), shutil.rmtree(f"{root}/{size_mb}-sync")
        b, s, r = (statistics.median(times[k]) * 1e3 for k in ("async", "sync", "restore"))
        print(f"{size_mb:>8} {b:>17.1f} {s:>13.1f} {b / s:>13.3f} {r:>11.1f}", flush=True)
        results[size_mb] = {"async_ms": b, "sync_ms": s, "restore_ms": r}
    if not args.directory:
        shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
