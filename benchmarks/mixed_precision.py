"""What does mixed precision (``compute_dtype``) change against float32: step time, final accuracy or loss?

Mixed precision (``DataParallel(compute_dtype=...)``) against float32: step time and final accuracy or loss.

Runs the MNIST-1D CNN example and the byte-level LM example as their commands run them, with
``compute_dtype=float32`` and ``compute_dtype=bfloat16`` (and, for the CNN, ``float16`` with ``--float16``): the CNN
through ``DataParallel(compute_dtype=...)``, the LM through its Flax modules' own ``dtype`` (Flax's policy: the same
casts, written in the model), interleaved
(float32, bfloat16, float32, bfloat16, ...) so that the machine's load falls on both alike. Each run is a fresh
process; the figures are fit's own summary: the median step time (``step_s / steps``, compile excluded) and the
final test accuracy (CNN) or test loss (LM). Printed: medians over ``--repeats`` runs and the ratio to float32.

    python -m benchmarks mixed_precision [--repeats 3] [--devices 2] [--cnn-epochs 10] [--lm-steps 150] [--float16]

On CPU, XLA computes bfloat16 without native instructions on most processors, so the step can be slower than
float32's; the figures say how much, on the machine they ran on.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
RESULT = re.compile(r"^result: (.*)$", re.MULTILINE)


def run(example: str, overrides: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    argv = [sys.executable, "-m", f"examples.{example}.train", *overrides, "log_dir=''", "progress=false"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    found = RESULT.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return {k: float(v) for k, v in (item.split("=") for item in found.group(1).split())}


QUICK: dict[str, Any] = {"repeats": 1, "cnn_epochs": 1, "lm_steps": 5}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each dtype, interleaved (default: 3)")
    parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices of the one process (default: 2)")
    parser.add_argument("--cnn-epochs", type=int, default=10, help="MNIST-1D CNN epochs (default: 10)")
    parser.add_argument("--lm-steps", type=int, default=150, help="LM training steps, over 30 (default: 150)")
    parser.add_argument("--float16", action="store_true", help="also float16 with dynamic loss scaling")
    return parser


def bench(args: argparse.Namespace) -> Any:
    cnn_dtypes = ["float32", "bfloat16", *(["float16"] if args.float16 else [])]
    cases = {
        "MNIST-1D CNN": (
            "mnist1d",
            ["config=configs/mnist1d_cnn.yaml", f"epochs={args.cnn_epochs}"],
            "test_accuracy",
            cnn_dtypes,
        ),
        "LM": ("lm", ["config=configs/lm.yaml", f"steps={args.lm_steps}"], "test_loss", ["float32", "bfloat16"]),
    }
    print(f"mixed precision: {args.devices} simulated devices, {args.repeats} interleaved runs per dtype")
    results = {}
    for name, (example, overrides, quality, dtypes) in cases.items():
        seen: dict[str, list[dict[str, float]]] = {d: [] for d in dtypes}
        for _ in range(args.repeats):
            for dtype in dtypes:
                seen[dtype].append(run(example, [*overrides, f"devices={args.devices}", f"compute_dtype={dtype}"]))
        step_ms = {d: statistics.median(1000 * r["step_s"] / r["steps"] for r in seen[d]) for d in dtypes}
        results[name] = {"step_ms": step_ms, "runs": seen}
        for dtype in dtypes:
            value = statistics.median(r[quality] for r in seen[dtype])
            ratio = step_ms[dtype] / step_ms["float32"]
            runs = ", ".join(f"{r[quality]:.4f}" for r in seen[dtype])
            print(
                f"  {name:<13} {dtype:<9} step {step_ms[dtype]:7.2f} ms median ({ratio:.2f}x float32's), "
                f"{quality} {value:.4f} (median; runs: {runs})"
            )
    return results


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
