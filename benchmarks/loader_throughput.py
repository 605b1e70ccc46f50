"""Does the loader outrun what the training step consumes, and how much does it slow the training loop?

Loader throughput against what the training step consumes, and the loop's slowdown.

1. ``jddp.data.DataLoader`` on a NumPy source of 200k x 40 float32 (+ int32
   labels), global batch 256, shuffled, with 0, 1 and 2 Grain worker
   processes: examples/s of whole global batches handed out (reads, gather,
   transfer to the devices), and the main process's CPU time per batch.
2. The MNIST-1D MLP training step (40-256-256-10, AdamW) on the same devices:
   examples/s it consumes with pre-staged batches (already on the devices).
3. The training loop fed by the loader against the same loop over pre-staged
   batches, in many short interleaved rounds (every order of the variants in
   turn). Each round gives a ratio to the pre-staged round next to it; the
   slowdown is the median ratio with a bootstrap 95% interval. A second set of
   pre-staged batches runs as a control ("A/A"): its figure is the noise floor.
   Wall time is the target; process CPU time per step is printed too, because on
   a shared machine it moves much less with other processes' load, and with the
   devices saturating the cores, extra CPU is what turns into slowdown.

    python -m benchmarks loader_throughput --devices 8
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

QUICK: dict[str, Any] = {
    "devices": 2,
    "examples": 4096,
    "global_batch_size": 64,
    "batches": 10,
    "repeats": 1,
    "rounds": 6,
    "steps": 2,
}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--examples", type=int, default=200_000, help="source size")
    p.add_argument("--global-batch-size", type=int, default=256, help="examples per global batch")
    p.add_argument("--batches", type=int, default=400, help="batches timed per loader measurement")
    p.add_argument("--repeats", type=int, default=3, help="loader windows per worker count (median)")
    p.add_argument("--rounds", type=int, default=120, help="interleaved rounds for the loop comparison")
    p.add_argument("--steps", type=int, default=10, help="steps per round")
    p.add_argument("--prefetch", type=int, default=2, help="loader prefetch (0: read in the training thread)")
    return p


def median_ci(ratios) -> tuple[float, float, float]:
    """Median of ``ratios`` - 1 and its bootstrap 95% interval (``harness.bootstrap_median``)."""
    import numpy as np

    r = np.asarray(ratios) - 1
    return (float(np.median(r)), *harness.bootstrap_median(r))


def bench(args: argparse.Namespace) -> Any:
    import jddp

    jddp.simulate_cpu_devices(args.devices)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jddp.benchmark import models

    rng = np.random.default_rng(0)
    source = {
        "x": rng.normal(size=(args.examples, 40)).astype(np.float32),
        "y": rng.integers(0, 10, args.examples).astype(np.int32),
    }
    bs = args.global_batch_size

    def endless(loader):
        while True:
            yield from loader  # one epoch per pass, as a training loop reads it

    def loader_rates(workers: int) -> tuple[float, float]:
        """Median examples/s and main-process CPU s per batch over ``repeats`` windows of one iterator."""
        loader = jddp.data.DataLoader(
            source, global_batch_size=bs, seed=1, worker_count=workers, prefetch=args.prefetch
        )
        it = endless(loader)
        for _ in range(20):  # start the workers, fill the buffers
            jax.block_until_ready(next(it))
        runs = []
        for _ in range(args.repeats):
            t, cpu = time.perf_counter(), time.process_time()
            for batch in itertools.islice(it, args.batches):
                jax.block_until_ready(batch)
            runs.append((args.batches * bs / (time.perf_counter() - t), (time.process_time() - cpu) / args.batches))
        it.close()
        return float(np.median([r[0] for r in runs])), float(np.median([r[1] for r in runs]))

    rates, cpus = {}, {}
    for w in (0, 1, 2):
        rates[w], cpus[w] = loader_rates(w)

    def loss(model, batch, rng):
        logits = model(batch["x"])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        accuracy = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        return jddp.masked_mean(ce, batch["mask"]), {"accuracy": jddp.masked_mean(accuracy, batch["mask"])}

    graphdef, params, model_state = models.mnist1d_mlp(hidden=256, seed=0)  # examples/mnist1d's MLP
    dp = jddp.DataParallel(jddp.models.nnx_loss(graphdef, loss), optax.adamw(1e-3), mesh=jddp.data_mesh())
    state = dp.init(params, model_state)
    loader = jddp.data.DataLoader(source, global_batch_size=bs, seed=1, prefetch=args.prefetch)
    host = list(itertools.islice(loader.local_batches(), 2 * args.steps))
    staged = [loader.to_global(b) for b in host[: args.steps]]
    staged_again = [loader.to_global(b) for b in host[args.steps :]]
    batches = iter(loader)

    def pre_staged(batch_list):
        def run():
            s = state
            for b in batch_list:
                s, m = dp.step(s, b)
            jax.block_until_ready(m)
            return s

        return run

    def from_loader():
        nonlocal batches
        s = state
        for _ in range(args.steps):
            b = next(batches, None)
            if b is None:  # next epoch
                batches = iter(loader)
                b = next(batches)
            s, m = dp.step(s, b)
        jax.block_until_ready(m)
        return s

    variants = {"pre-staged": pre_staged(staged), "A/A control": pre_staged(staged_again), "loader": from_loader}
    for run in variants.values():
        state = run()
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _, name in harness.permuted(list(variants), args.rounds):
        t, c = time.perf_counter(), time.process_time()
        state = variants[name]()
        wall[name].append((time.perf_counter() - t) / args.steps)
        cpu[name].append((time.process_time() - c) / args.steps)
    med = {k: float(np.median(v)) for k, v in wall.items()}
    consumed = bs / med["pre-staged"]
    slow = {k: median_ci(np.divide(wall[k], wall["pre-staged"])) for k in ("loader", "A/A control")}
    slow_cpu = {k: median_ci(np.divide(cpu[k], cpu["pre-staged"])) for k in ("loader", "A/A control")}

    print(f"source {args.examples} x 40 float32, global batch {bs}, {args.devices} simulated devices, 2-core CPU")
    for w, rate in rates.items():
        print(f"loader, {w} workers: {rate:>10,.0f} examples/s ({rate / consumed:5.1f}x what the step consumes), "
              f"main process CPU {cpus[w] * 1e6:4.0f} us/batch")  # fmt: skip
    print(f"MNIST-1D MLP step consumes: {consumed:>10,.0f} examples/s (pre-staged batches, median)")
    print(f"loop, {args.rounds} interleaved rounds x {args.steps} steps; ms per step: median [p25, p75], CPU")
    for k, v in wall.items():
        p25, p75 = np.percentile(v, [25, 75]) * 1e3
        print(f"  {k:12s} {med[k] * 1e3:6.3f} [{p25:6.3f}, {p75:6.3f}]   CPU {np.median(cpu[k]) * 1e3:6.3f}")
    for label, figures in (("wall", slow), ("CPU ", slow_cpu)):
        print(f"{label} per step vs pre-staged, median ratio [95% CI]: "
              + ", ".join(f"{k} {m:+.1%} [{lo:+.1%}, {hi:+.1%}]" for k, (m, lo, hi) in figures.items()))  # fmt: skip
    print("targets: loader >= 10x the step's consumption; slowdown <= 5%")
    return {
        "consumed": consumed,
        "slowdown": slow["loader"][0],
        "slowdown_ci": slow["loader"][1:],
        "control": slow["A/A control"][0],
        "cpu_slowdown": slow_cpu["loader"][0],
        **{f"workers{w}": r for w, r in rates.items()},
    }


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
