"""What every benchmark shares: the machine record, load sampling, interleaved pairing and the one JSON schema.

A benchmark module states its question in its docstring's first line, builds its own ``argparse`` parser and
measures in a function ``measure(args) -> dict``; its ``main(argv)`` is one call to ``run`` here, which adds the
shared flags (``--json FILE``, ``--quick``, ``--require-quiet``), records the machine and samples the load average
while ``measure`` runs, and writes one record, the same keys for every benchmark::

    {"benchmark": "step_overhead", "question": "...", "machine": {...}, "load": {...}, "busy": false,
     "args": {...}, "results": {...}, "date": "...", "commit": "..."}

The load is sampled by ``jddp.benchmark.noise.LoadSampler`` (``jddp bench``'s, the one implementation; its record
holds ``cores``). The machine is busy when the 1-minute load average, at the start, in any sample or at the end, is
above the core count: the figures are then a loaded machine's. The record says so (``"busy": true``) and a warning
is printed; with ``--require-quiet`` the benchmark refuses to start on a busy machine and refuses to report (exit 3,
no JSON) when it became busy during the run.

Pairing: ``abba`` and ``permuted`` give the order of the arms round by round, so that machine noise falls on all
of them alike; ``interleave`` times callables in that order; ``compare`` turns two arms' paired figures into their
medians, the ratio of the medians, the median of the pairs' ratios and its bootstrap interval (``bootstrap_median``;
``bootstrap_total`` for the ratio of the totals).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jddp.benchmark import noise

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ("benchmark", "question", "machine", "load", "busy", "args", "results", "date", "commit")
SAMPLE_EVERY_S = noise.SAMPLE_EVERY_S
NOT_QUIET_EXIT = 3  # --require-quiet on a busy machine
VERSIONED = ("jax", "jaxlib", "numpy", "optax", "orbax-checkpoint", "torch")


# --- the machine -------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo``, or ``"unknown"``."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return found[1].strip() if found else "unknown"


def versions() -> dict[str, str]:
    """Python's version and the installed versions of jddp and the packages its figures depend on."""
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in ("jddp", *VERSIONED):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def machine() -> dict[str, Any]:
    """Cores, CPU model, memory, platform and versions: what a figure needs beside it to be compared."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {
        "cores": os.cpu_count(),
        "cpu": cpu_model(),
        "memory_gib": round(memory / 2**30, 1),
        "platform": " ".join(os.uname()[i] for i in (0, 2, 4)),  # system, release, machine (no subprocess)
        "versions": versions(),
    }


def commit() -> str:
    """The repository's short commit, or ``"unknown"`` outside a git checkout."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


# The load average and its sampler are ``jddp bench``'s (one implementation): the record holds the 1-minute load at
# the start, every ``SAMPLE_EVERY_S`` and at the end, its maximum, and the core count it is compared with.
loadavg = noise.loadavg
LoadSampler = noise.LoadSampler


def busy(load: Mapping[str, Any], cores: int | None) -> bool:
    """Whether the 1-minute load average went above the core count at any point ``load`` recorded."""
    return load["max"] > (cores or 1)


# --- pairing -----------------------------------------------------------------------------------------------------


def ab_order(names: Sequence[str], r: int) -> list[str]:
    """Round ``r``'s order of the arms: as given in even rounds, reversed in odd ones."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def abba(names: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, name)`` in the order A B, B A, A B, ...: the order reversed every other round, so that no arm
    always runs first."""
    for r in range(rounds):
        for name in ab_order(names, r):
            yield r, name


def permuted(names: Sequence[str], rounds: int) -> Iterator[tuple[int, str]]:
    """``(round, name)`` with every order of ``names`` in turn, one per round (for three or more arms, where
    reversing alone leaves one in the middle)."""
    orders = list(itertools.permutations(names))
    for r in range(rounds):
        for name in orders[r % len(orders)]:
            yield r, name


def interleave(
    arms: Mapping[str, Callable[[], Any]],
    rounds: int,
    order: Callable[[Sequence[str], int], Iterator[tuple[int, str]]] = abba,
) -> dict[str, list[Any]]:
    """Calls each arm once per round in ``order`` and collects what it returns (a time, or a dict of figures)
    per arm; an arm that returns ``None`` (a failed run) adds nothing."""
    out: dict[str, list[Any]] = {name: [] for name in arms}
    for _, name in order(list(arms), rounds):
        value = arms[name]()
        if value is not None:
            out[name].append(value)
    return out


def timed(fn: Callable[[], Any], per: int = 1) -> Callable[[], float]:
    """``fn`` as an arm of ``interleave`` that returns its wall time in ms, divided by ``per`` (steps)."""

    def arm() -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3 / per

    return arm


def bootstrap_median(values: Sequence[float], draws: int = 10000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median of ``values`` resampled with replacement (``draws`` times):
    how well the runs pin the median down on a machine whose pairs of runs differ by more than the cost."""
    rng = np.random.default_rng(seed)
    medians = np.median(rng.choice(np.asarray(values), size=(draws, len(values))), axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def bootstrap_total(a: Sequence[float], b: Sequence[float], draws: int = 10000, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of sum(a)/sum(b) over the pairs resampled with replacement."""
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(a), size=(draws, len(a)))
    totals = np.asarray(a)[pick].sum(axis=1) / np.asarray(b)[pick].sum(axis=1)
    return float(np.percentile(totals, 2.5)), float(np.percentile(totals, 97.5))


def compare(a: Sequence[float], b: Sequence[float], draws: int = 10000, seed: int = 0) -> dict[str, Any]:
    """Two arms' paired figures (pair i: ``a[i]`` and ``b[i]``, run side by side; extra unpaired figures count
    in the medians only): each median, the ratio of the medians a/b, the pairs' ratios, their median and its 95%
    bootstrap interval."""
    ratios = [x / y for x, y in zip(a, b, strict=False)]
    low, high = bootstrap_median(ratios, draws, seed) if ratios else (float("nan"), float("nan"))
    median_a, median_b = float(np.median(a)), float(np.median(b))
    return {
        "median_a": median_a,
        "median_b": median_b,
        "ratio_of_medians": median_a / median_b,
        "pair_ratios": ratios,
        "median_pair_ratio": float(np.median(ratios)) if ratios else float("nan"),
        "ci95": [low, high],
    }


# --- one run, one record ----------------------------------------------------------------------------------------


def question(doc: str | None) -> str:
    """A benchmark's question: its module docstring's first line."""
    return (doc or "").strip().splitlines()[0] if (doc or "").strip() else ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every benchmark takes."""
    group = parser.add_argument_group("harness (every benchmark)")
    group.add_argument("--json", default=None, metavar="FILE", help="write the run's record (one schema) to FILE")
    group.add_argument("--quick", action="store_true", help="a tiny size, in seconds to a minute: a smoke run")
    group.add_argument(
        "--require-quiet",
        action="store_true",
        help=f"refuse to start or to report when the load average is above the core count (exit {NOT_QUIET_EXIT})",
    )


def parse(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, quick: Mapping[str, Any] | None = None
) -> argparse.Namespace:
    """Parses ``argv`` with the shared flags added; with ``--quick`` the defaults become ``quick``'s (a flag given
    on the command line still wins)."""
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--quick" in argv and quick:
        parser.set_defaults(**quick)
    return parser.parse_args(argv)


def name_of(module: str) -> str:
    """``benchmarks.step_overhead`` -> ``step_overhead``; ``benchmarks.peers.run`` -> ``peers``; a script run as
    ``__main__`` -> the name of its file."""
    if module == "__main__":
        module = Path(sys.argv[0]).stem
    parts = [p for p in module.split(".") if p not in ("benchmarks", "run")]
    return parts[-1] if parts else module


def record(name: str, doc: str | None, args: argparse.Namespace, load: dict, results: Any) -> dict[str, Any]:
    """One run's record: ``SCHEMA``'s keys, in that order."""
    about = machine()
    return {
        "benchmark": name,
        "question": question(doc),
        "machine": about,
        "load": load,
        "busy": busy(load, about["cores"]),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "results": results,
        "date": datetime.datetime.now(datetime.UTC).strftime("%d %b %Y %H:%M UTC"),
        "commit": commit(),
    }


def refuse_if_busy(args: argparse.Namespace, when: str, load: float) -> None:
    """With ``--require-quiet``: ends the run (exit ``NOT_QUIET_EXIT``) when ``load`` is above the core count."""
    cores = os.cpu_count() or 1
    if getattr(args, "require_quiet", False) and load > cores:
        print(f"harness: load average {load:.2f} above {cores} cores {when}: --require-quiet, not reported",
              file=sys.stderr, flush=True)  # fmt: skip
        raise SystemExit(NOT_QUIET_EXIT)


def run(
    module: str,
    doc: str | None,
    parser: argparse.ArgumentParser,
    measure: Callable[[argparse.Namespace], Any],
    argv: Sequence[str] | None = None,
    quick: Mapping[str, Any] | None = None,
) -> Any:
    """Runs one benchmark: parses ``argv`` (``parse``), samples the load while ``measure(args)`` runs, prints the
    load and a warning on a busy machine, writes the record to ``--json`` and returns ``measure``'s results. A
    benchmark's own worker processes (``args.worker`` set) run ``measure`` bare: they are part of a run."""
    args = parse(parser, argv, quick)
    if getattr(args, "worker", False):
        return measure(args)
    name = name_of(module)
    refuse_if_busy(args, "at the start", loadavg()[0])
    sampler = LoadSampler().start()
    results = measure(args)
    load = sampler.stop()
    out = record(name, doc, args, load, results)
    print(f"{name}: load average {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end, "
          f"at most {load['max']:.2f} on {out['machine']['cores']} cores", flush=True)  # fmt: skip
    if out["busy"]:
        print(f"WARNING: {name} ran on a busy machine (load above the core count): its figures are a loaded "
              "machine's", flush=True)  # fmt: skip
        refuse_if_busy(args, "during the run", load["max"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"{name}: record written to {args.json}", flush=True)
    return results
