"""How far ``jddp bench``'s figures can be trusted: the machine's load, each figure's spread, and noise flags.

**Load.** Two records, both in the report's JSON. The load average (``LoadSampler``: the 1-minute load at the start,
every ``SAMPLE_EVERY_S`` and at the end; ``benchmarks/harness.py`` samples with this one) counts the benchmark's own
processes too: on a machine with few cores a configuration of 8 simulated devices alone lifts it past the core count. So
each configuration also gets ``others_cores`` (``OtherLoad``, Linux): the CPU time every other process on the machine
used while it ran, in cores, from ``/proc/stat``'s busy time less this process's and its waited-for children's
(``resource.getrusage``), over the wall time.

**Spread.** Every timed program gives one time per timed run (``--rounds`` x ``--repeats``); each figure of a row
is computed from the medians and shown with the range the same formula gives from the quartiles (``figure_ranges``:
the lower quartile of a numerator against the upper quartile of its denominator, and so on).

**Noise.** Some figures cannot be true of the step, only of the machine, and ``flags`` names them, each with its
reason: an efficiency over 100% (the devices share the same cores, so more than linear scaling says that the
1-device run was measured slower, not that the step scales); a bare step (no collective) slower than the
hand-written step, which does the same work plus a ``pmean``, or slower than jddp's (the overhead is then shown
as 0% beside a ``jddp/hand`` ratio that says otherwise); a spread wider than ``WIDE_SPREAD``; other processes
using ``BUSY_OTHERS_CORES`` cores or more. The table marks those figures with ``!`` and prints a ``noise:`` line
for each (``jddp.cli.bench``).

Imports no JAX.
"""

from __future__ import annotations

import os
import resource
import statistics
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

SAMPLE_EVERY_S = 5.0  # benchmarks/harness.py's records use it too
# A figure whose jddp step times' interquartile range is wider than this share of their median is flagged: at
# 25% the ranges of two rows that differ by a few tens of percent overlap, and no ratio between them holds.
WIDE_SPREAD = 0.25
# Other processes that used half a core or more on average while a configuration ran: one busy process beside the
# benchmark takes about 1 core; half of one already moved the figures by tens of percent on the 2-core machine.
BUSY_OTHERS_CORES = 0.5


def loadavg() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 2 decimals."""
    return [round(x, 2) for x in os.getloadavg()]


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds in a daemon thread between ``start`` and ``stop`` (also
    the sampler of ``benchmarks/harness.py``'s records)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S):
        self.every_s = every_s
        self.start_load: list[float] = []
        self.end_load: list[float] = []
        self.samples: list[tuple[float, float]] = []  # (seconds since the start, 1-minute load)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="load-sampler", daemon=True)
        self._t0 = 0.0

    def start(self) -> LoadSampler:
        self.start_load, self._t0 = loadavg(), time.monotonic()
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append((round(time.monotonic() - self._t0, 1), loadavg()[0]))

    def stop(self) -> dict[str, Any]:
        """Stops sampling; the record: ``start``, ``end``, ``samples``, ``max`` (1-minute), ``every_s``, ``cores``."""
        self._stop.set()
        self._thread.join()
        self.end_load = loadavg()
        ones = [self.start_load[0], *(x for _, x in self.samples), self.end_load[0]]
        return {"start": self.start_load, "end": self.end_load, "samples": self.samples, "max": max(ones),
                "every_s": self.every_s, "cores": os.cpu_count() or 1}  # fmt: skip


def _busy_cpu_s() -> float | None:
    """Seconds of CPU time the whole machine spent busy since boot (``/proc/stat``), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is already in user time


def _own_cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # waited-for descendants: the launcher, its workers
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class OtherLoad:
    """The CPU other processes used between ``start()`` and ``stop()``, in cores (see the module docstring)."""

    def start(self) -> OtherLoad:
        self._busy, self._own, self._wall = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
        return self

    def stop(self) -> float | None:
        """Cores' worth of CPU the other processes used on average; None where ``/proc/stat`` is missing."""
        busy, own, wall = _busy_cpu_s(), _own_cpu_s(), time.monotonic() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return None
        return max(0.0, ((busy - self._busy) - (own - self._own)) / wall)


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """The lower quartile, the median and the upper quartile (linear interpolation, as NumPy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("`values` must hold at least one timing, got values=[]")

    def at(q: float) -> float:
        pos = (len(ordered) - 1) * q
        lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return at(0.25), statistics.median(ordered), at(0.75)


def figure_ranges(raw: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """Each derived figure of a row at the quartiles of its timings: ``{figure: (low, high)}``; ``raw`` and ``base``
    (the 1-process, 1-device configuration) are the workers' merged timings (``jddp.cli.bench._merge``)."""
    s1, _, s3 = quartiles(raw["jddp_ms"])
    h1, _, h3 = quartiles(raw["hand_ms"])
    l1, _, l3 = quartiles(raw["local_ms"])
    b1, _, b3 = quartiles(base["jddp_ms"])
    scale = raw["global_batch"] / base["global_batch"]  # speedup = scale * base step / step
    lat1, _, lat3 = quartiles(raw["latency_ms"])
    compiles = raw.get("compile_s_runs") or [raw["compile_s"]]
    return {
        "step_ms": (s1, s3),
        "throughput": (raw["global_batch"] / s3 * 1e3, raw["global_batch"] / s1 * 1e3),
        "speedup": (scale * b1 / s3, scale * b3 / s1),
        "efficiency": (scale * b1 / s3 / raw["devices"], scale * b3 / s1 / raw["devices"]),
        "latency_median_ms": (lat1, lat3),
        "allreduce_share": (max(0.0, 1 - l3 / s1), max(0.0, 1 - l1 / s3)),
        "overhead_vs_hand": (s1 / h3, s3 / h1),
        "compile_s": (min(compiles), max(compiles)),
    }


def flags(row: Mapping[str, Any], *, others_cores: float | None = None) -> dict[str, str]:
    """The figures of ``row`` (``jddp.cli.bench.summarize``'s, with its ``ranges``) that are noise: ``{figure:
    reason}``; ``"row"`` for what makes every figure of the row doubtful."""
    found: dict[str, str] = {}
    where = f"{row['processes']} process(es), {row['devices']} device(s)"
    if row["efficiency"] > 1:
        found["efficiency"] = (
            f"efficiency {100 * row['efficiency']:.0f}% at {where} is over 100%: the simulated devices share the "
            "same cores, so the 1-device run was measured slower than it runs (load), not a step that scales past "
            "linear"
        )
    step, hand, local = row["step_ms"], row["hand_ms"], row["local_ms"]
    if local > hand:
        found["allreduce_share"] = (
            f"overhead {100 * row['allreduce_share']:.0f}% beside jddp/hand {row['overhead_vs_hand']:.2f}x at "
            f"{where}: the bare step (no collective, {local:.3g} ms) was measured slower than the hand-written "
            f"step ({hand:.3g} ms), which does the same work and a pmean"
        )
    elif local > step:
        found["allreduce_share"] = (
            f"overhead shown as 0% at {where}: jddp's step ({step:.3g} ms) was measured faster than the bare step "
            f"({local:.3g} ms), which does less"
        )
    s1, s3 = row["ranges"]["step_ms"]
    if s3 - s1 > WIDE_SPREAD * step:
        found["step_ms"] = (
            f"jddp's step times at {where} spread {s1:.3g}-{s3:.3g} ms (interquartile), wider than "
            f"{100 * WIDE_SPREAD:.0f}% of their median {step:.3g} ms"
        )
    if others_cores is not None and others_cores >= BUSY_OTHERS_CORES:
        found["row"] = (
            f"other processes used {others_cores:.2f} cores on average while {where} ran (jddp bench's own "
            "processes not counted): every figure of the row is a loaded machine's"
        )
    return found


def busy_note(load: Mapping[str, Any]) -> str | None:
    """A ``noise:`` reason when the load average went above the core count during the run, else None."""
    if load["max"] <= load["cores"]:
        return None
    return (
        f"the 1-minute load average reached {load['max']:.2f} on {load['cores']} cores (start {load['start'][0]:.2f}, "
        f"end {load['end'][0]:.2f}; it counts jddp bench's own processes too: see each row's others' load)"
    )
