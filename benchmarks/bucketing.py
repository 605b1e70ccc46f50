"""How much step time per example and how many compilations does bucketing by length save on SST-2-like data?

A bidirectional tanh RNN classifier (``benchmarks/sentences.py``) trained with ``jddp.DataParallel`` on
synthetic sentences whose lengths follow SST-2's (most under 30 tokens, a tail to 60), two ways:

* ``padded``: ``DataLoader`` without buckets, every sentence padded to the longest (60);
* ``bucketed``: ``DataLoader(buckets=jddp.data.Buckets(boundaries, length="length", pad={"tokens": 0}))``.

Reported per arm: XLA compilations during the first epoch (``jax.monitoring``'s backend-compile events) and in
the epochs after it (0 expected), the padding fraction (token slots of the batches that hold no token, over one
epoch's global batches, from the samplers' plans), and the wall time per real example of whole epochs, the two
arms interleaved (``harness.abba``) after a warm-up epoch, with the median of the per-round ratios and its
bootstrap 95% interval.

    python -m benchmarks bucketing                    # 8 simulated devices, 16k sentences, batch 128
    python -m benchmarks bucketing --quick            # a smoke run
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

QUICK: dict[str, Any] = {"devices": 2, "examples": 512, "global_batch_size": 32, "rounds": 2}


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=harness.question(__doc__))
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--examples", type=int, default=16384, help="sentences in the source")
    p.add_argument("--global-batch-size", type=int, default=128, help="sentences per global batch")
    p.add_argument("--boundaries", default="16,24,32,48,60", help="bucket boundaries (comma-separated)")
    p.add_argument("--max-len", type=int, default=60, help="the longest sentence, what the padded arm pads to")
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds of one epoch per arm")
    return p


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import jddp

    jddp.simulate_cpu_devices(args.devices)
    import jax
    import numpy as np
    import optax

    from benchmarks import sentences

    data = sentences.sentences(args.examples, max_len=args.max_len)
    boundaries = tuple(int(b) for b in args.boundaries.split(","))
    buckets = jddp.data.Buckets(boundaries=boundaries, length="length", pad={"tokens": sentences.PAD})

    def loss_fn(params, model_state, batch, rng):
        out = sentences.logits(params, batch["tokens"], batch["length"])
        ce = optax.softmax_cross_entropy_with_integer_labels(out, batch["y"])
        return jddp.masked_mean(ce, batch["mask"]), (model_state, {})

    compiles: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    mesh = jddp.data_mesh()
    arms: dict[str, Any] = {}
    results: dict[str, Any] = {"lengths": length_summary(data["length"]), "boundaries": list(boundaries)}
    for name, option in (("padded", None), ("bucketed", buckets)):
        loader = jddp.data.DataLoader(data, global_batch_size=args.global_batch_size, seed=0, buckets=option, mesh=mesh)
        dp = jddp.DataParallel(loss_fn, optax.adam(1e-3), mesh=mesh)
        state = dp.init(sentences.init())
        before = len(compiles)
        state, first = epoch(dp, state, loader)  # the warm-up epoch: every shape compiled
        arms[name] = {"loader": loader, "dp": dp, "state": state}
        results[name] = {
            "compilations_first_epoch": len(compiles) - before,
            "shapes": sorted(first["shapes"]),
            "padding_fraction": padding_fraction(loader, data["length"], args.max_len),
            "steps_per_epoch": len(loader),
            "examples_per_epoch": first["examples"],
        }

    def run_epoch(name: str):
        def arm() -> float:
            a = arms[name]
            start = time.perf_counter()
            a["state"], info = epoch(a["dp"], a["state"], a["loader"])
            return (time.perf_counter() - start) / info["examples"] * 1e6  # µs per real example

        return arm

    after = len(compiles)
    times = harness.interleave({n: run_epoch(n) for n in arms}, args.rounds)
    jax.monitoring.unregister_event_duration_listener(listener)
    for name in arms:
        results[name]["us_per_example"] = times[name]
        results[name]["us_per_example_median"] = float(np.median(times[name]))
    results["compilations_after_first_epoch_both"] = len(compiles) - after
    results["bucketed_over_padded"] = harness.compare(times["bucketed"], times["padded"])
    show(results, args)
    return results


def epoch(dp, state, loader) -> tuple[Any, dict[str, Any]]:
    """One epoch of steps; the state, the batch shapes seen and the real examples trained on."""
    import jax

    shapes, examples, metrics = set(), 0, None
    for batch in loader:
        shapes.add(next(f.shape for f in batch.layout if f.name == "tokens"))
        state, metrics = dp.step(state, batch)
        examples += loader.global_batch_size
    jax.block_until_ready(metrics)
    return state, {"shapes": shapes, "examples": examples}


def padding_fraction(loader, lengths, max_len: int) -> float:
    """The share of token slots in one epoch's global batches that hold no token (padding rows count whole)."""
    sampler, slots, tokens = loader.sampler, 0, 0
    for position in range(len(sampler)):
        indices, mask, _ = sampler.global_batch(position)
        width = sampler.boundary_at(position) if hasattr(sampler, "boundary_at") else max_len
        slots += len(indices) * width
        tokens += int(lengths[indices][mask > 0].sum())
    return 1.0 - tokens / slots


def length_summary(lengths) -> dict[str, float]:
    import numpy as np

    return {
        "mean": float(lengths.mean()),
        "median": float(np.median(lengths)),
        "p90": float(np.percentile(lengths, 90)),
        "under_30": float((lengths < 30).mean()),
        "max": int(lengths.max()),
    }


def show(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"{args.examples} sentences (lengths {results['lengths']}), global batch {args.global_batch_size}, "
          f"{args.devices} simulated devices, boundaries {results['boundaries']}")  # fmt: skip
    for name in ("padded", "bucketed"):
        r = results[name]
        print(f"{name:>9}: {r['compilations_first_epoch']} compilations in the first epoch, shapes {r['shapes']}, "
              f"padding {r['padding_fraction']:.1%}, {r['us_per_example_median']:.1f} µs per example (median of "
              f"{len(r['us_per_example'])} epochs)")  # fmt: skip
    c = results["bucketed_over_padded"]
    print(f"bucketed / padded time per example: median pair ratio {c['median_pair_ratio']:.3f} "
          f"(95% CI {c['ci95'][0]:.3f}-{c['ci95'][1]:.3f}); compilations after the first epoch: "
          f"{results['compilations_after_first_epoch_both']}")  # fmt: skip


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
