"""jddp bench's doubt (jddp.benchmark.noise): every figure's spread, and no impossible figure printed unflagged.

Generated timings, no timing here: the table printed from them is read back as a user reads it.
"""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jddp.benchmark import noise
from jddp.cli import bench

times = st.lists(st.floats(0.5, 50.0), min_size=1, max_size=9)


@st.composite
def raws(draw):
    """The workers' merged timings for the baseline and a few more configurations."""
    configs = [(1, 1), *draw(st.sets(st.sampled_from([(1, 2), (1, 4), (1, 8), (2, 2), (2, 8)]), max_size=3))]
    compiles = [draw(st.lists(st.floats(0.1, 5.0), min_size=1, max_size=3)) for _ in configs]
    return [
        {"processes": p, "devices": d, "global_batch": 64 * d, "jddp_ms": draw(times), "hand_ms": draw(times),
         "local_ms": draw(times), "latency_ms": draw(times), "compile_s": float(np.median(runs)),
         "compile_s_runs": runs, "grad_bytes": 4, "others_cores": draw(st.none() | st.floats(0.0, 3.0))}
        for (p, d), runs in zip(sorted(configs), compiles, strict=True)
    ]  # fmt: skip


loads = st.builds(
    lambda start, peak, end, cores: {"start": [start], "end": [end], "max": max(start, peak, end), "cores": cores},
    st.floats(0, 8), st.floats(0, 8), st.floats(0, 8), st.integers(1, 8),
)  # fmt: skip


def _cells(table: str, n_rows: int) -> tuple[list[str], list[list[str]], list[str]]:
    lines = table.splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.split()[:2] == ["proc", "dev"]]
    columns = re.split(r"\s{2,}", lines[at].strip())
    rows = [re.split(r"\s{2,}", line.strip()) for line in lines[at + 1 : at + 1 + n_rows]]
    return columns, rows, lines[at + 1 + n_rows :]


def _value(cell: str) -> float:
    found = re.match(r"[\d.]+", cell)
    assert found is not None, cell
    return float(found.group())


@settings(max_examples=300, deadline=None)
@given(raw=raws(), load=loads)
def test_no_impossible_figure_is_printed_without_a_noise_mark_and_its_reason(raw, load):
    rows = bench.summarize(raw)
    columns, cells, after = _cells(bench.format_table(rows, load), len(rows))
    text = "\n".join(after).replace("\n    ", " ")
    notes = [line for line in text.splitlines() if line.startswith("noise: ")]
    col = {name: i for i, name in enumerate(columns)}
    for row, cell in zip(rows, cells, strict=True):
        where = f"{row['processes']} process(es), {row['devices']} device(s)"
        efficiency = cell[col["efficiency"]]
        if row["efficiency"] > 1:  # more than linear on devices that share the cores
            assert efficiency.endswith("!"), (efficiency, row)
            assert any(f"efficiency {_value(efficiency):.0f}% at {where} is over 100%" in n for n in notes), notes
        overhead, ratio = _value(cell[col["overhead"]]) / 100, _value(cell[col["jddp/hand"]])
        # jddp/hand = r means jddp's step is (1 - 1/r) over a step that does the bare work and more: an overhead
        # over the bare step below that (beyond the cells' rounding) contradicts the ratio printed beside it
        if overhead + 0.005 < 1 - 1 / (ratio - 0.0005):
            assert cell[col["overhead"]].rstrip("*").endswith("!"), (cell, row)
            assert any(f"at {where}" in n and "overhead" in n for n in notes), notes
        if row["step_ms"] > row["local_ms"] <= row["hand_ms"]:  # consistent timings: no overhead flag
            assert not cell[col["overhead"]].rstrip("* ").endswith("!"), (cell, row)
        if (row["others_cores"] or 0) >= noise.BUSY_OTHERS_CORES:
            assert cell[col["dev"]].endswith("!") and any(f"while {where} ran" in n for n in notes), notes
    assert any("the 1-minute load average reached" in n for n in notes) == (load["max"] > load["cores"])
    assert len(notes) == sum(len(r["noise"]) for r in rows) + (load["max"] > load["cores"])


@settings(max_examples=300, deadline=None)
@given(raw=raws())
def test_each_figure_lies_within_its_range_at_the_quartiles(raw):
    rows = bench.summarize(raw)
    for row in rows:
        for figure, (lo, hi) in row["ranges"].items():
            value = row[figure]
            assert lo <= value * (1 + 1e-12) and value <= hi * (1 + 1e-12), (figure, lo, value, hi)
    for r in raw:  # the quartiles against NumPy's (linear interpolation)
        for key in ("jddp_ms", "hand_ms", "local_ms", "latency_ms"):
            assert noise.quartiles(r[key]) == pytest.approx(tuple(np.percentile(r[key], [25, 50, 75])))


@given(values=st.lists(st.floats(0.5, 50.0), min_size=1, max_size=9), wide=st.booleans())
def test_a_wide_spread_of_step_times_is_flagged(values, wide):
    raw = [{"processes": 1, "devices": 1, "global_batch": 64, "jddp_ms": values, "hand_ms": [100.0],
            "local_ms": [0.1], "latency_ms": [1.0], "compile_s": 1.0, "grad_bytes": 4}]  # fmt: skip
    (row,) = bench.summarize(raw)
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    assert ("step_ms" in row["noise"]) == (q3 - q1 > noise.WIDE_SPREAD * median)


def test_quartiles_of_nothing_are_refused():
    with pytest.raises(ValueError, match=r"`values` must hold at least one timing, got values=\[\]"):
        noise.quartiles([])


def test_the_other_processes_load_is_the_machines_busy_time_less_ours_over_the_wall(monkeypatch):
    clock = {"busy": 100.0, "own": 10.0, "wall": 5.0}
    monkeypatch.setattr(noise, "_busy_cpu_s", lambda: clock["busy"])
    monkeypatch.setattr(noise, "_own_cpu_s", lambda: clock["own"])
    monkeypatch.setattr(noise.time, "monotonic", lambda: clock["wall"])
    others = noise.OtherLoad().start()
    clock.update(busy=106.0, own=12.0, wall=9.0)  # 6 s busy of which 2 s ours, in 4 s: 1 core of others
    assert others.stop() == pytest.approx(1.0)
    monkeypatch.setattr(noise, "_busy_cpu_s", lambda: None)  # no /proc/stat
    assert noise.OtherLoad().start().stop() is None


def test_the_machines_busy_time_counts_our_own_cpu_and_no_more_than_the_cores_give():
    cores = os.cpu_count() or 1
    busy, own, wall = noise._busy_cpu_s(), noise._own_cpu_s(), time.monotonic()
    assert busy is not None, "/proc/stat unreadable"
    end = time.process_time() + 0.5
    while time.process_time() < end:
        pass
    after = noise._busy_cpu_s()
    assert after is not None
    d_busy, d_own, d_wall = after - busy, noise._own_cpu_s() - own, time.monotonic() - wall
    assert 0.8 * d_own <= d_busy <= 1.1 * cores * d_wall + 0.05, (d_busy, d_own, d_wall)
