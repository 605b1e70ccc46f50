"""Loader throughput against what the training step consumes, and the loop's slowdown.

1. ``jddp.data.DataLoader`` on a NumPy source of 200k x 40 float32 (+ int32
   labels), global batch 256, shuffled, with 0, 1 and 2 Grain worker
   processes: examples/s of whole global batches handed out (reads, gather,
   global array assembly).
2. The MNIST-1D MLP training step on the same device setup: examples/s it
   consumes with pre-staged batches (already on the devices).
3. The training loop fed by the loader against the same loop over pre-staged
   batches, interleaved round by round: the slowdown.

    python -m benchmarks.loader_throughput --devices 8
"""

from __future__ import annotations

import argparse
import itertools
import time


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--examples", type=int, default=200_000, help="source size")
    p.add_argument("--global-batch-size", type=int, default=256, help="examples per global batch")
    p.add_argument("--batches", type=int, default=300, help="batches timed per loader measurement")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds for the loop comparison")
    p.add_argument("--steps", type=int, default=40, help="steps per round")
    p.add_argument("--prefetch", type=int, default=2, help="loader prefetch (0: read in the training thread)")
    return p


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = get_args_parser().parse_args(argv)
    import jddp

    jddp.simulate_cpu_devices(args.devices)
    import jax
    import numpy as np
    import optax

    from examples.mnist1d import train as mnist1d

    rng = np.random.default_rng(0)
    source = {
        "x": rng.normal(size=(args.examples, 40)).astype(np.float32),
        "y": rng.integers(0, 10, args.examples).astype(np.int32),
    }
    bs = args.global_batch_size

    def loader_rate(workers: int) -> float:
        loader = jddp.data.DataLoader(
            source, global_batch_size=bs, seed=1, worker_count=workers, prefetch=args.prefetch
        )
        it = iter(loader)
        for _ in range(5):  # start the workers, fill the buffers
            jax.block_until_ready(next(it))
        t = time.perf_counter()
        for batch in itertools.islice(it, args.batches):
            jax.block_until_ready(batch)
        rate = args.batches * bs / (time.perf_counter() - t)
        it.close()
        return rate

    rates = {w: loader_rate(w) for w in (0, 1, 2)}

    config = mnist1d.Config(devices=0, global_batch_size=bs)
    graphdef, params, model_state = mnist1d.make_model(config)
    loss_fn = jddp.models.nnx_loss(graphdef, lambda m, b, r: mnist1d.classification_metrics(m(b["x"]), b))
    dp = jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=jddp.data_mesh())
    state = dp.init(params, model_state)
    loader = jddp.data.DataLoader(source, global_batch_size=bs, seed=1, prefetch=args.prefetch)
    staged = [loader.to_global(b) for b in itertools.islice(loader.local_batches(), args.steps)]
    batches = iter(loader)

    def run_staged():
        nonlocal state
        for b in staged:
            state, m = dp.step(state, b)
        jax.block_until_ready(m)

    def run_loader():
        nonlocal state, batches
        for _ in range(args.steps):
            b = next(batches, None)
            if b is None:
                batches = iter(loader)
                b = next(batches)
            state, m = dp.step(state, b)
        jax.block_until_ready(m)

    for run in (run_staged, run_loader):
        run()
    times: dict[str, list[float]] = {"pre-staged": [], "loader": []}
    for r in range(args.rounds):
        order = [("pre-staged", run_staged), ("loader", run_loader)]
        for name, run in order if r % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t) / args.steps)
    med = {k: float(np.median(v)) for k, v in times.items()}
    consumed = bs / med["pre-staged"]

    print(f"source {args.examples} x 40 float32, global batch {bs}, {args.devices} simulated devices, 2-core CPU")
    for w, rate in rates.items():
        print(f"loader, {w} workers: {rate:>10,.0f} examples/s  ({rate / consumed:.1f}x what the step consumes)")
    print(f"MNIST-1D MLP step consumes: {consumed:>10,.0f} examples/s (pre-staged batches, median)")
    slowdown = med["loader"] / med["pre-staged"] - 1
    print(f"loop per step: pre-staged {med['pre-staged'] * 1e3:.3f} ms, loader {med['loader'] * 1e3:.3f} ms, "
          f"slowdown {slowdown:+.1%} (medians of {args.rounds} interleaved rounds)")  # fmt: skip
    print("targets: loader >= 10x the step's consumption; slowdown <= 5%")
    return {
        "consumed": consumed,
        "slowdown": med["loader"] / med["pre-staged"] - 1,
        **{f"workers{w}": r for w, r in rates.items()},
    }


if __name__ == "__main__":
    main()
