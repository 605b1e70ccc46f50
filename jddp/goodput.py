"""Goodput: where a run's wall time went, across its restarts.

**Runs and attempts.** ``jddp.fit`` with a ``log_dir`` gives every run an id
(``20261124-153012-a3f9``: its start in UTC and 4 random hex digits) and keeps
a ledger per attempt of the run (a process's run of the script). A call of
``fit`` continues a run, as a new attempt of it, when

1. it resumed from a checkpoint that run saved (the id is saved with every
   checkpoint ``fit`` writes) and the run has steps left to take (the restored
   step is below the run's length): a restart after a kill, a requeue, a rerun
   by hand, also a longer run continued from a finished one's last checkpoint;
2. or ``jddp launch`` restarted the group (``$JDDP_RESTART_COUNT`` > 0): the run
   of that launcher's earlier attempts (known by the launcher's start,
   ``$JDDP_RUN_START``), also when no checkpoint was saved yet.

Anything else is a new run: a fresh start into a folder that holds a finished
run (or an unfinished one it did not resume), a second ``fit`` in one script.

The ledgers live in ``log_dir/goodput/<run>/attempt-NNNN.ledger`` (beside
``run.json``: the id and the launchers that ran it), small memory-mapped files
written by process 0 after every step (a few stores to memory, no system call),
so an attempt that is SIGKILLed leaves its ledger complete up to its last step.
Each attempt's account is written to ``metrics.jsonl`` as a ``goodput`` record
with the run's id: by the next attempt when it starts (the killed one cannot),
or by the attempt itself when ``fit`` ends, which also writes a
``goodput_total`` record and prints the summary line. ``jddp goodput RUN_DIR``
prints the same line for the same span, the table, and draws ``goodput.png``.

**The span.** Goodput and its parts cover the run from its start (the first
attempt's: under ``jddp launch``, the launcher's start) to the end of its last
``fit``. The time after that, ``teardown_s`` (the rest of the script, the
processes' exit, the launcher's end: ``jddp launch`` writes its end into the
ledger named in ``$JDDP_LEDGER_NOTE``), is shown apart by ``jddp goodput``,
with the goodput over the span that includes it; ``fit`` ends before it.

**The parts** of an attempt, in seconds, add up to its span:

* ``startup_s``: from the attempt's start to ``fit``: the interpreter, imports,
  ``jddp.initialize``, building the model. The start is the launcher's
  (``$JDDP_ATTEMPT_START``), else when ``jddp`` was first imported (or, for a
  second ``fit`` in one process, the first one's end).
* ``restore_s``: ``restore_or_init``. ``compile_s``: the first step.
* ``step_s``: training steps, the productive time (less ``recomputed_s``).
* ``data_wait_s``, ``checkpoint_s`` (blocking time of saves), ``eval_s``.
* ``other_s``: ``fit``'s remaining time (logging, replica checks, the plot).
* ``recomputed_s``: steps this attempt took that the next one took again
  after restoring an older checkpoint (``recomputed_steps`` of them), at this
  attempt's mean time per step; moved out of ``step_s`` and ``data_wait_s``.
  A step counts as taken once ``dp.step`` returned for it.
* ``lost_s``: from the attempt's last step to its end, for an attempt that
  did not finish: the work since the last step, noticing the failure, and
  stopping the group. Its end is the launcher's (``$JDDP_PREVIOUS_END``, the
  time the whole group had stopped), else the last step.
* ``downtime_s``: from this attempt's end to the next attempt's start.

Each instant of the span is counted once (``account``): an attempt's time that
overlaps the next attempt's (clocks of two hosts, a group still stopping while
the next one started) is the next attempt's, taken off this one's ``lost_s``,
then ``other_s`` and ``startup_s``; timers that add up to more than the time
between ``fit``'s start and the last step (two clocks again: the timers are
``time.perf_counter``'s, the ledger's times ``time.time``'s) are scaled down to it.
So the parts of a run sum to its span exactly, never past 100%
(``tests/test_goodput.py`` checks it on generated ledgers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import secrets
import struct
import time
from pathlib import Path

from jddp import envvars

LEDGER_DIR = "goodput"
RUN_FILE = "run.json"  # in each run's folder: {"run": id, "created": time, "launchers": [$JDDP_RUN_START, ...]}
TIMERS = ("restore_s", "compile_s", "step_s", "data_wait_s", "checkpoint_s", "eval_s")  # fit's own timers
# The ledger file's float64 slots, in file order.
SLOTS = (
    "attempt_start",
    "fit_start",
    *TIMERS,
    "first_step",
    "last_step",
    "steps_run",
    "last_update",
    "end",
    "previous_end",
    "closed",
    "teardown_end",
    "first_step_end",
    "restored_from",
    "processes",  # the group's processes in this attempt ($JDDP_NUM_PROCESSES; 1 alone)
    "nodes",  # an elastic round's nodes ($JDDP_MEMBERSHIP, jddp.cli.launch.elastic); 0: a fixed membership
    "round",  # that round's number
)
# Slots that older ledgers lack (written before them): read as 0, or 1 process.
_ADDED_SLOTS = ("restored_from", "processes", "nodes", "round")
# Where an attempt's state came from (the "restored_from" slot): jddp.Checkpointer.restored_from.
RESTORED_FROM = ("none", "disk", "memory", "peer")
# An attempt's account: its parts add up to its span (module docstring); the teardown comes after the span.
PARTS = ("startup_s", *TIMERS, "other_s", "recomputed_s", "lost_s", "downtime_s")
TEARDOWN = "teardown_s"
# Where an overlap with the next attempt, or timers beyond the wall time, are taken from first (module docstring).
CUT_FIRST = ("lost_s", "other_s", "startup_s")
_IMPORTED_AT = time.time()  # this process's start, as near as jddp can tell without a launcher
_last_fit_end: float | None = None  # a second fit in the same process starts its attempt here


def _env_time(name: str) -> float | None:
    """A time the launcher passed (``JDDP_ATTEMPT_START``, ``JDDP_PREVIOUS_END``), parsed by ``jddp.envvars``."""
    return envvars.get(name)


def mark_teardown(note: str | os.PathLike) -> None:
    """``jddp launch``, at its end: writes the time into the ledger whose path process 0 wrote in ``note``
    (imports no NumPy or JAX)."""
    try:
        path = Path(note).read_text().strip()
        with open(path, "r+b") as f:
            os.pwrite(f.fileno(), struct.pack("<d", time.time()), 8 * SLOTS.index("teardown_end"))
    except (OSError, ValueError):
        pass  # no fit with a log_dir ran, or its directory is gone: nothing to account


# ------------------------------------------------------------------------------------------------------ runs


def new_run_id() -> str:
    """A new run's id: its start in UTC and 4 random hex digits (sorts by start)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def run_dir(log_dir: str | os.PathLike, run: str) -> Path:
    """Where run ``run``'s ledgers are: ``log_dir/goodput/<run>``."""
    return Path(log_dir) / LEDGER_DIR / run


def run_info(log_dir: str | os.PathLike, run: str) -> dict:
    """The run's ``run.json`` (``{}`` when missing or unreadable)."""
    try:
        return json.loads((run_dir(log_dir, run) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}


def runs(log_dir: str | os.PathLike) -> list[str]:
    """The runs with ledgers in ``log_dir``, oldest first."""
    base = Path(log_dir) / LEDGER_DIR
    if not base.is_dir():
        return []
    found = [p.name for p in base.iterdir() if p.is_dir() and any(p.glob("attempt-*.ledger"))]
    return sorted(found, key=lambda r: (run_info(log_dir, r).get("created", math.inf), r))


def choose_run(log_dir: str | os.PathLike, resumed: str | None) -> tuple[str, str]:
    """The run a ``fit`` into ``log_dir`` belongs to, and why (the rules of the module docstring).

    Args:
      log_dir: ``fit``'s ``log_dir``.
      resumed: the run id of the checkpoint ``fit`` resumed from, if the run has steps left; else None.
    """
    if resumed:
        return resumed, "resumed from its checkpoint"
    launcher, restart = envvars.get("JDDP_RUN_START"), envvars.get("JDDP_RESTART_COUNT") or 0
    if launcher is not None and restart > 0:
        for run in reversed(runs(log_dir)):
            if launcher in run_info(log_dir, run).get("launchers", []):
                return run, f"restarted by jddp launch (restart {restart})"
    return new_run_id(), "new"


def _note_run(directory: Path, run: str) -> None:
    """Writes (or extends) the run's ``run.json``: its id, creation time and the launcher running it."""
    path = directory / RUN_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        info = {"run": run, "created": time.time(), "launchers": []}
    launcher = envvars.get("JDDP_RUN_START")
    if launcher is not None and launcher not in info["launchers"]:
        info["launchers"].append(launcher)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


class Ledger:
    """This attempt's ledger (process 0 of a ``fit`` with a ``log_dir``); see the module docstring."""

    def __init__(
        self, directory: Path, first_step: int, *, fit_start: float | None = None, restored_from: str | None = None
    ):
        """``directory``: the run's (``run_dir``); ``fit_start``: when ``fit`` began (default now);
        ``restored_from``: ``"disk"``, ``"memory"``, ``"peer"`` (``jddp.Checkpointer.restored_from``) or None."""
        import numpy as np

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        _note_run(directory, directory.name)
        self.directory = directory
        self.run = directory.name
        self.index = len(list(directory.glob("attempt-*.ledger")))
        self.path = directory / f"attempt-{self.index:04d}.ledger"
        now = time.time()
        fit_start = now if fit_start is None else min(fit_start, now)
        start = _last_fit_end if _last_fit_end is not None else _env_time("JDDP_ATTEMPT_START") or _IMPORTED_AT
        previous_end = _env_time("JDDP_PREVIOUS_END") if _last_fit_end is None else None
        values: dict[str, float] = dict.fromkeys(SLOTS, 0.0)
        values["attempt_start"], values["fit_start"], values["last_update"] = min(start, fit_start), fit_start, now
        values["first_step"] = values["last_step"] = float(first_step)
        values["previous_end"] = math.nan if previous_end is None else previous_end
        values["restored_from"] = float(RESTORED_FROM.index(restored_from or "none"))
        values["processes"] = float(envvars.get("JDDP_NUM_PROCESSES") or 1)
        membership = envvars.get("JDDP_MEMBERSHIP") or {}
        for key in ("nodes", "round"):
            value = membership.get(key)
            values[key] = float(value) if isinstance(value, int) and not isinstance(value, bool) else 0.0
        tmp = self.path.with_name(self.path.name + ".tmp")
        np.array([values[k] for k in SLOTS], np.float64).tofile(tmp)
        os.replace(tmp, self.path)
        self._slots = np.memmap(self.path, dtype=np.float64, mode="r+", shape=(len(SLOTS),))
        self._at = {k: i for i, k in enumerate(SLOTS)}
        note = envvars.get("JDDP_LEDGER_NOTE")
        if note:  # tell jddp launch where to write its end (teardown_s)
            with contextlib.suppress(OSError):
                Path(note).write_text(str(self.path.resolve()))

    def __getitem__(self, name: str) -> float:
        return float(self._slots[self._at[name]])

    def __setitem__(self, name: str, value: float) -> None:
        self._slots[self._at[name]] = value

    def update(self, step: int, steps_run: int, times: dict[str, float]) -> None:
        """After each step: the step reached and the timers so far (seconds)."""
        s, at = self._slots, self._at
        for name in TIMERS:
            s[at[name]] = times.get(name, 0.0)
        s[at["last_step"]] = step
        s[at["steps_run"]] = steps_run
        now = s[at["last_update"]] = time.time()
        if steps_run == 1 and not s[at["first_step_end"]]:
            s[at["first_step_end"]] = now  # when this attempt's first step was done (restart benchmarks)

    def start_at(self, step: int) -> None:
        """The step this attempt starts from (after its restore)."""
        self["first_step"] = self["last_step"] = step

    def finish(self, step: int, steps_run: int, times: dict[str, float]) -> None:
        """``fit`` is done: the final timers, and the end."""
        global _last_fit_end
        self.update(step, steps_run, times)
        self["end"] = self["last_update"]
        _last_fit_end = self["end"]
        self._slots.flush()

    def open_accounts(self) -> list[tuple[Path, dict[str, float]]]:
        """The accounts of this run's earlier attempts not yet in ``metrics.jsonl``, each with its ledger's path."""
        paths = sorted(self.directory.glob("attempt-*.ledger"))
        accounts = ledger_accounts(paths)
        return [(p, a) for p, a in zip(paths, accounts, strict=True) if p != self.path and not read(p)["closed"]]


def read(path: Path) -> dict[str, float]:
    import numpy as np

    values = np.fromfile(path, dtype=np.float64)
    missing = len(SLOTS) - values.size
    if 0 < missing <= len(_ADDED_SLOTS):  # written before the last slots: none restored, 1 process, fixed nodes
        values = np.append(values, [1.0 if k == "processes" else 0.0 for k in SLOTS[values.size :]])
    if values.size != len(SLOTS):
        raise ValueError(f"{path} is not a goodput ledger of this jddp version ({values.size} slots).")
    return dict(zip(SLOTS, values.tolist(), strict=True))


def close(path: Path) -> None:
    """Marks a ledger's account as written to ``metrics.jsonl``."""
    import numpy as np

    slots = np.memmap(path, dtype=np.float64, mode="r+", shape=(len(SLOTS),))
    slots[SLOTS.index("closed")] = 1.0
    slots.flush()


# -------------------------------------------------------------------------------------------------- accounts


def _floor6(seconds: float) -> float:
    """``seconds`` to the microsecond below."""
    return math.floor(seconds * 1e6) / 1e6


def _fit_into(parts: dict[str, float], span: float) -> dict[str, float]:
    """``parts`` (each >= 0, summing to at least ``span``) cut down to sum to ``span``: from ``CUT_FIRST`` in that
    order, then all of them in proportion."""
    excess = sum(parts.values()) - span
    for name in CUT_FIRST:
        if excess <= 0:
            break
        taken = min(parts[name], excess)
        parts[name] -= taken
        excess -= taken
    total = sum(parts.values())
    if excess > 0 and total > 0:
        parts = {k: v * span / total for k, v in parts.items()}
    return parts


def account(
    ledger: dict[str, float],
    index: int,
    *,
    next_start: float | None,
    next_first_step: int | None,
    end: float | None = None,
    not_before: float | None = None,
) -> dict[str, float]:
    """One attempt's parts (see the module docstring) from its ledger.

    Args:
      ledger: ``read(path)``.
      index: the attempt's number (0 first).
      next_start, next_first_step: the next attempt's start and restored step (None for the last attempt).
      end: when the attempt ended, if known from outside (the launcher's ``JDDP_PREVIOUS_END``); else its own end
        for a finished attempt, or its last step for one that was stopped.
      not_before: where the previous attempt's account ended (its end plus its downtime): this one starts there
        at the earliest, so that no instant is counted twice.

    Returns:
      ``attempt``, ``start`` and ``end`` (the span, teardown excluded), the ``PARTS`` (summing to
      ``end - start + downtime_s``), ``teardown_s`` (last attempt only), ``recomputed_steps``, ``steps``,
      ``first_step``, ``last_step`` and ``finished``.
    """
    timers = {k: max(0.0, ledger[k]) if math.isfinite(ledger[k]) else 0.0 for k in TIMERS}
    measured = sum(timers.values())
    finished = ledger["end"] > 0
    last = ledger["end"] if finished else ledger["last_update"]
    if end is None or math.isnan(end) or end < last:
        end = last
    start = ledger["attempt_start"] if not_before is None else max(ledger["attempt_start"], not_before)
    steps_run = max(0, int(ledger["steps_run"]))
    redone = 0
    if next_first_step is not None:
        redone = max(0, min(int(ledger["last_step"]) - next_first_step, steps_run))
    busy = timers["step_s"] + timers["data_wait_s"]
    recomputed = redone * busy / steps_run if steps_run else 0.0
    if recomputed:
        share = timers["step_s"] / busy
        timers["step_s"] -= recomputed * share
        timers["data_wait_s"] -= recomputed * (1 - share)
    fit_start = max(ledger["fit_start"], start)
    within = max(0.0, last - fit_start)  # fit's time to its last step, which its timers divide
    scale = min(1.0, within / measured) if measured > 0 else 1.0  # timers past it (clocks): scaled down to it
    raw = {
        "startup_s": fit_start - start,
        **{k: v * scale for k, v in timers.items()},
        "other_s": within - measured * scale,
        "recomputed_s": recomputed * scale,
        "lost_s": max(0.0, end - max(last, start)),
    }  # sums to at least end - start (exactly, unless the last step came before fit's start)
    cut = end if next_start is None else min(end, next_start)
    span_end = max(start, cut)
    parts = _fit_into({k: max(0.0, v) for k, v in raw.items()}, span_end - start)
    parts["downtime_s"] = max(0.0, next_start - span_end) if next_start is not None else 0.0
    teardown = ledger["teardown_end"] - span_end if next_start is None and ledger["teardown_end"] > 0 else 0.0
    return {
        "attempt": float(index),
        "start": start,
        "end": span_end,
        **{k: _floor6(parts[k]) for k in PARTS},  # rounded down: the sum stays within the span
        TEARDOWN: _floor6(max(0.0, teardown)),
        "recomputed_steps": float(redone),
        "steps": float(steps_run),
        "first_step": ledger["first_step"],
        "last_step": ledger["last_step"],
        "finished": float(finished),
        "restored_from": ledger.get("restored_from", 0.0),
        "processes": ledger.get("processes", 1.0),
        "nodes": ledger.get("nodes", 0.0),
        "round": ledger.get("round", 0.0),
    }


def accounts(ledgers: list[dict[str, float]], indices: list[int] | None = None) -> list[dict[str, float]]:
    """The accounts of a run's attempts, in order (each with its successor's start, restored step and the
    launcher's end of it), each starting where the previous one's ends: the parts sum to the run's span."""
    indices = list(range(len(ledgers))) if indices is None else indices
    out: list[dict[str, float]] = []
    not_before = None
    for i, ledger in enumerate(ledgers):
        following = ledgers[i + 1] if i + 1 < len(ledgers) else None
        a = account(
            ledger,
            indices[i],
            next_start=following["attempt_start"] if following else None,
            next_first_step=int(following["first_step"]) if following else None,
            end=following["previous_end"] if following else None,
            not_before=not_before,
        )
        not_before = a["end"] + a["downtime_s"]
        out.append(a)
    return out


def ledger_accounts(paths: list[Path]) -> list[dict[str, float]]:
    """``accounts`` of the ledgers at ``paths`` (``attempt-NNNN.ledger``, in order)."""
    return accounts([read(p) for p in paths], [int(p.stem.split("-")[1]) for p in paths])


@dataclasses.dataclass(frozen=True)
class Total:
    """A run's account over its attempts: ``parts`` sum to ``wall_s``, the span from the run's start to the end
    of its last ``fit``; ``teardown_s`` came after it."""

    parts: dict[str, float]
    wall_s: float
    attempts: int
    recomputed_steps: int
    teardown_s: float = 0.0
    run: str = ""

    @classmethod
    def of(cls, records: list[dict], run: str = "") -> Total:
        records = sorted(records, key=lambda r: r["attempt"])
        parts = {k: float(sum(r.get(k, 0.0) for r in records)) for k in PARTS}
        wall = records[-1]["end"] - records[0]["start"] if records else 0.0
        teardown = float(records[-1].get(TEARDOWN, 0.0)) if records else 0.0
        steps = int(sum(r.get("recomputed_steps", 0) for r in records))
        return cls(parts, wall, len(records), steps, teardown, run)

    @property
    def goodput(self) -> float:
        return self.parts["step_s"] / self.wall_s if self.wall_s > 0 else 0.0

    def record(self) -> dict[str, float]:
        return {
            **{k: _floor6(v) for k, v in self.parts.items()},
            "wall_s": round(self.wall_s, 6),
            "goodput": round(self.goodput, 6),
            "attempts": float(self.attempts),
            "recomputed_steps": float(self.recomputed_steps),
        }

    def line(self) -> str:
        """The summary ``fit`` prints at its end and ``jddp goodput`` prints for the same span."""
        shown = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in self.parts.items() if v >= 0.05)
        return (
            f"goodput of run {self.run}: {100 * self.goodput:.1f}% of {self.wall_s:.1f} s, from the run's start to "
            f"the end of its last fit, over {self.attempts} attempt(s) ({self.recomputed_steps} steps recomputed): "
            f"{shown}"
        )

    def table(self) -> str:
        rows = [f"{'part':<14}{'seconds':>10}{'share':>9}"]
        for k, v in self.parts.items():
            share = v / self.wall_s if self.wall_s > 0 else 0.0
            rows.append(f"{k[:-2]:<14}{v:>10.2f}{100 * share:>8.1f}%")
        accounted = sum(self.parts.values())
        rows.append(f"{'sum of parts':<14}{accounted:>10.2f}{100 * accounted / max(self.wall_s, 1e-9):>8.1f}%")
        rows.append(f"{'wall':<14}{self.wall_s:>10.2f}   (the run's start to the end of its last fit)")
        rows.append(
            f"goodput (step time / wall): {100 * self.goodput:.1f}%, attempts {self.attempts}, "
            f"steps recomputed {self.recomputed_steps}"
        )
        if self.teardown_s > 0:
            whole = self.wall_s + self.teardown_s
            rows.append(
                f"after the span, teardown (the script's end, the processes' exit, jddp launch's end): "
                f"{self.teardown_s:.2f} s; with it, goodput {100 * self.parts['step_s'] / whole:.1f}% of {whole:.2f} s"
            )
        return "\n".join(rows)


def run_records(log_dir: str | os.PathLike, run: str | None = None) -> list[dict]:
    """Every attempt's account of run ``run`` (default the newest), from its ledgers in ``log_dir/goodput/<run>``,
    else from the run's ``goodput`` records of ``metrics.jsonl`` (ledgers deleted)."""
    from jddp import logs

    log_dir = Path(log_dir)
    known = runs(log_dir)
    run = run if run is not None else (known[-1] if known else None)
    paths = sorted(run_dir(log_dir, run).glob("attempt-*.ledger")) if run else []
    if paths:
        return ledger_accounts(paths)
    records = [r for r in logs.read_metrics(log_dir / logs.METRICS_FILE) if r.get("split") == "goodput"]
    if run is None and records:
        run = records[-1].get("run")
    return sorted((r for r in records if r.get("run") == run), key=lambda r: r["attempt"])


def plot(total: Total, path: Path) -> None:
    """A horizontal bar chart of the parts (seconds), written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [k[:-2].replace("_", " ") for k in total.parts]
    figure = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    bars = ax.barh(names, list(total.parts.values()), color=["tab:green" if n == "step" else "tab:gray" for n in names])
    ax.bar_label(bars, labels=[f"{v:.1f} s" for v in total.parts.values()], fontsize=8, padding=2)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"goodput {100 * total.goodput:.1f}% of {total.wall_s:.1f} s over {total.attempts} attempt(s)")
    figure.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    figure.savefig(tmp, format="png")
    os.replace(tmp, path)


def get_args_parser():
    """``jddp goodput``'s arguments (an ``argparse.ArgumentParser``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="jddp goodput", description="Where a fit run's wall time went.")
    parser.add_argument("run_dir", help="the log_dir given to jddp.fit (holding metrics.jsonl and goodput/)")
    parser.add_argument(
        "--run", default=None, help="the run to show, of those listed (default: the newest run in RUN_DIR)"
    )
    parser.add_argument("--png", default=None, help="where to draw the chart (default RUN_DIR/goodput.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``jddp goodput RUN_DIR``: the run's account, and ``RUN_DIR/goodput.png``."""
    args = get_args_parser().parse_args(argv)
    log_dir = Path(args.run_dir)
    known = runs(log_dir)
    if args.run is not None and args.run not in known:
        listed = ", ".join(known) or "none"
        print(f"jddp goodput: no run {args.run!r} in {log_dir} (--run takes one of: {listed})", flush=True)
        return 2
    records = run_records(log_dir, args.run)
    if not records:
        print(
            f"jddp goodput: no goodput records or ledgers in {log_dir} (expected {log_dir}/metrics.jsonl and "
            f"{log_dir}/{LEDGER_DIR}/ from a jddp.fit run with log_dir={str(log_dir)!r})",
            flush=True,
        )
        return 2
    run = args.run or (known[-1] if known else str(records[-1].get("run", "")))
    if len(known) > 1:
        print(f"runs in {log_dir}, oldest first: {', '.join(known)} (showing {run}; --run to choose)")
    total = Total.of(records, run)
    for r in records:
        status = "finished" if r.get("finished") else "stopped"
        source = RESTORED_FROM[int(r.get("restored_from", 0))]
        print(
            f"attempt {int(r['attempt'])}: steps {int(r['first_step'])}..{int(r['last_step'])} ({status}), "
            f"{r['end'] - r['start']:.1f} s, recomputed {int(r.get('recomputed_steps', 0))} steps"
            + ("" if source == "none" else f", restored from {source}")
            + f", {int(r.get('processes', 1))} process(es)"
            + (f" on {int(r['nodes'])} node(s) (elastic round {int(r.get('round', 0))})" if r.get("nodes") else "")
        )
    print(total.line())
    print(total.table())
    png = Path(args.png) if args.png else log_dir / "goodput.png"
    plot(total, png)
    print(f"chart: {png}")
    return 0
