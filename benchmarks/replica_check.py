"""What does the replica check cost? ``dp.check_replicas`` against ``dp.step``, interleaved in one process.

The MNIST-1D MLP with AdamW (the state is the parameters and two moments) on simulated CPU devices. Each round
times ``--steps`` steps, then one check; prints the median step time, the median check time, and the share of
step time that one check every K steps costs (``jddp.fit``'s ``replica_check_every``, default 100).

    python -m benchmarks replica_check --devices 8 --hidden 256 --rounds 15
    python -m benchmarks replica_check --devices 8 --hidden 1024 --rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

QUICK: dict[str, Any] = {"devices": 2, "hidden": 32, "rounds": 2, "steps": 2}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--rounds", type=int, default=15, help="rounds of steps and one check")
    p.add_argument("--steps", type=int, default=20, help="steps per round")
    p.add_argument("--global-batch-size", type=int, default=256, help="examples per step")
    p.add_argument("--hidden", type=int, default=256, help="MLP width")
    p.add_argument("--every", type=int, nargs="*", default=[10, 100, 1000], help="check intervals to report")
    return p


def bench(args: argparse.Namespace) -> Any:
    import jddp

    jddp.simulate_cpu_devices(args.devices)
    import jax
    import optax

    from jddp import models as adapters
    from jddp.benchmark import models

    graphdef, params, model_state = models.mnist1d_mlp(args.hidden)

    def fn(model, batch, rng):
        return jddp.masked_mean(
            optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]), batch.get("mask")
        )

    dp = jddp.DataParallel(adapters.nnx_loss(graphdef, fn), optax.adamw(1e-3), mesh=jddp.data_mesh())
    state = dp.init(params, model_state)
    batches = models.synthetic_batches(args.steps, args.global_batch_size)
    state, _ = dp.step(state, batches[0])  # compile
    dp.check_replicas(state)  # compile
    jax.block_until_ready(state)
    step_times, check_times = [], []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for batch in batches:
            state, metrics = dp.step(state, batch)
        jax.block_until_ready((state, metrics))
        step_times.append((time.perf_counter() - start) / len(batches))
        start = time.perf_counter()
        dp.check_replicas(state)
        check_times.append(time.perf_counter() - start)
    step, check = statistics.median(step_times), statistics.median(check_times)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(
        f"devices {args.devices}, MLP hidden {args.hidden}, state {state_bytes / 2**20:.2f} MiB per replica, "
        f"global batch {args.global_batch_size}, {args.rounds} rounds"
    )
    print(f"step   median {step * 1e3:8.3f} ms")
    print(f"check  median {check * 1e3:8.3f} ms  ({check / step:.2f} steps)")
    out = {"step_ms": step * 1e3, "check_ms": check * 1e3}
    for every in args.every:
        share = check / (every * step)
        out[f"cost_every_{every}"] = share
        print(f"one check every {every:5d} steps: {100 * share:6.3f}% of step time")
    return out


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
