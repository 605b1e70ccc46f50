"""How long an async checkpoint blocks the training loop, against a synchronous save; and restore time.

    python benchmarks/checkpoint_stall.py [--sizes-mb 16,64,256] [--repeats 5] [--devices 2]

For each state size (float32 parameters, SGD so the optimizer state is empty),
the same ``jddp.Checkpointer`` code saves the state ``--repeats`` times:

* async: the time ``save()`` blocks the caller (device-to-host copy, digest,
  Orbax's synchronous part); the write continues in the background and is
  waited for, untimed, before the next save;
* sync: ``async_save=False``, the time until the checkpoint is published;
* restore: ``restore_or_init`` into a fresh state, digests checked.

Rounds alternate async and sync so that machine noise hits both. It prints
medians and the ratio blocked/sync per size. Target: at most 10% from 64 MB up.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--directory", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    import jddp

    jddp.simulate_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    root = args.directory or tempfile.mkdtemp(prefix="jddp-ckpt-bench-")
    print(f"jax {jax.__version__}, {jax.device_count()} devices, writing under {root}")
    print(f"{'state MB':>8} {'async blocked ms':>17} {'sync save ms':>13} {'blocked/sync':>13} {'restore ms':>11}")
    for size_mb in (int(s) for s in args.sizes_mb.split(",")):
        n = size_mb * 2**20 // 4 // 4  # four leaves
        params = {f"w{i}": np.random.default_rng(i).normal(size=(n,)).astype(np.float32) for i in range(4)}
        dp = jddp.DataParallel(
            lambda p, s, b, r: (jnp.mean(b["x"]) * p["w0"][0], (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh()
        )
        state = dp.init(params)
        blocked, synced, restored = [], [], []
        for round_ in range(args.repeats + 1):  # round 0 warms up (compiles the digest, starts Orbax)
            for mode in ("async", "sync") if round_ % 2 == 0 else ("sync", "async"):
                directory = f"{root}/{size_mb}-{mode}-{round_}"
                ckpt = jddp.Checkpointer(directory, async_save=(mode == "async"))
                start = time.perf_counter()
                ckpt.save(state)
                elapsed = time.perf_counter() - start
                ckpt.wait()
                if round_:
                    (blocked if mode == "async" else synced).append(elapsed)
                if mode == "sync":
                    fresh = dp.init(jax.tree.map(np.zeros_like, params))
                    start = time.perf_counter()
                    back = ckpt.restore_or_init(fresh)
                    jax.block_until_ready(back)
                    if round_:
                        restored.append(time.perf_counter() - start)
                    del back, fresh
                ckpt.close()
                shutil.rmtree(directory)
        b, s, r = (statistics.median(x) * 1e3 for x in (blocked, synced, restored))
        print(f"{size_mb:>8} {b:>17.1f} {s:>13.1f} {b / s:>13.3f} {r:>11.1f}")
    if not args.directory:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
