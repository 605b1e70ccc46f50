"""Goodput: where a run's wall time went, across its restarts.

``jddp.fit`` with a ``log_dir`` keeps a ledger per attempt (a process's run of
the script; a restart under ``jddp launch --max-restarts``, a requeue, a rerun
by hand are new attempts). It lives in a small memory-mapped file,
``log_dir/goodput/attempt-NNNN.ledger``, written by process 0 after every step
(a few stores to memory, no system call), so an attempt that is SIGKILLed
leaves its ledger complete up to its last step. Each attempt's account is
written to ``metrics.jsonl`` as a ``goodput`` record: by the next attempt when
it starts (the killed one cannot), or by the attempt itself when ``fit`` ends,
which also writes a ``goodput_total`` record and prints a summary line.
``jddp goodput RUN_DIR`` prints the table and draws ``goodput.png``.

The parts of an attempt, in seconds, add up to its wall time:

* ``startup_s``: from the attempt's start to ``fit``: the interpreter, imports,
  ``jddp.initialize``, building the model. The start is the launcher's
  (``$JDDP_ATTEMPT_START``), else when ``jddp`` was first imported.
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
* ``teardown_s``: after the last attempt's ``fit``: the rest of the script,
  the processes' exit, the launcher's end (``jddp launch`` writes its end
  into the ledger named in ``$JDDP_LEDGER_NOTE``; ``jddp goodput`` shows it,
  the ``goodput_total`` record of ``metrics.jsonl``, written before, cannot).

Under ``jddp launch`` the first attempt starts with the launcher itself, so
the run's wall time (the last attempt's end, teardown included, minus the first
one's start) is the launcher's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import struct
import time
from pathlib import Path

from jddp import envvars

LEDGER_DIR = "goodput"
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
)
# An attempt's account: its parts add up to its wall time (module docstring).
PARTS = ("startup_s", *TIMERS, "other_s", "recomputed_s", "lost_s", "downtime_s", "teardown_s")
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


class Ledger:
    """This attempt's ledger (process 0 of a ``fit`` with a ``log_dir``); see the module docstring."""

    def __init__(self, log_dir: Path, first_step: int):
        import numpy as np

        directory = Path(log_dir) / LEDGER_DIR
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.index = len(list(directory.glob("attempt-*.ledger")))
        self.path = directory / f"attempt-{self.index:04d}.ledger"
        now = time.time()
        start = _last_fit_end if _last_fit_end is not None else _env_time("JDDP_ATTEMPT_START") or _IMPORTED_AT
        previous_end = _env_time("JDDP_PREVIOUS_END") if _last_fit_end is None else None
        values: dict[str, float] = dict.fromkeys(SLOTS, 0.0)
        values["attempt_start"], values["fit_start"], values["last_update"] = min(start, now), now, now
        values["first_step"] = values["last_step"] = float(first_step)
        values["previous_end"] = math.nan if previous_end is None else previous_end
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
        """The accounts of the earlier attempts not yet in ``metrics.jsonl``, each with its ledger's path (each
        attempt's successor gives its end, the restored step and the start)."""
        paths = sorted(self.directory.glob("attempt-*.ledger"))
        out = []
        for i, path in enumerate(paths[:-1]):
            ledger = read(path)
            if path == self.path or ledger["closed"]:
                continue
            following = read(paths[i + 1])
            index = int(path.stem.split("-")[1])
            out.append(
                (
                    path,
                    account(
                        ledger,
                        index,
                        next_start=following["attempt_start"],
                        next_first_step=int(following["first_step"]),
                        end=following["previous_end"],
                    ),
                )
            )
        return out


def read(path: Path) -> dict[str, float]:
    import numpy as np

    values = np.fromfile(path, dtype=np.float64)
    if values.size != len(SLOTS):
        raise ValueError(f"{path} is not a goodput ledger of this jddp version ({values.size} slots).")
    return dict(zip(SLOTS, values.tolist(), strict=True))


def close(path: Path) -> None:
    """Marks a ledger's account as written to ``metrics.jsonl``."""
    import numpy as np

    slots = np.memmap(path, dtype=np.float64, mode="r+", shape=(len(SLOTS),))
    slots[SLOTS.index("closed")] = 1.0
    slots.flush()


def account(
    ledger: dict[str, float],
    index: int,
    *,
    next_start: float | None,
    next_first_step: int | None,
    end: float | None = None,
) -> dict[str, float]:
    """One attempt's parts (see the module docstring) from its ledger.

    Args:
      ledger: ``read(path)``.
      index: the attempt's number (0 first).
      next_start, next_first_step: the next attempt's start and restored step (None for the last attempt).
      end: when the attempt ended, if known from outside (the launcher's ``JDDP_PREVIOUS_END``); else its own end
        for a finished attempt, or its last step for one that was stopped.
    """
    timers = {k: ledger[k] for k in TIMERS}
    finished = ledger["end"] > 0
    last = ledger["end"] if finished else ledger["last_update"]
    if end is None or math.isnan(end) or end < last:
        end = last
    steps_run = int(ledger["steps_run"])
    redone = 0
    if next_first_step is not None:
        redone = max(0, min(int(ledger["last_step"]) - next_first_step, steps_run))
    per_step = (timers["step_s"] + timers["data_wait_s"]) / steps_run if steps_run else 0.0
    recomputed = redone * per_step
    if recomputed and per_step:
        share = timers["step_s"] / (timers["step_s"] + timers["data_wait_s"])
        timers["step_s"] -= recomputed * share
        timers["data_wait_s"] -= recomputed * (1 - share)
    parts = {
        "startup_s": ledger["fit_start"] - ledger["attempt_start"],
        **timers,
        "other_s": max(0.0, last - ledger["fit_start"] - sum(ledger[k] for k in TIMERS)),
        "recomputed_s": recomputed,
        "lost_s": end - last,
        "downtime_s": max(0.0, next_start - end) if next_start is not None else 0.0,
        "teardown_s": max(0.0, ledger["teardown_end"] - end) if ledger["teardown_end"] > 0 else 0.0,
    }
    return {
        "attempt": float(index),
        "start": ledger["attempt_start"],
        "end": end + parts["teardown_s"],
        **{k: round(v, 6) for k, v in parts.items()},
        "recomputed_steps": float(redone),
        "steps": float(steps_run),
        "first_step": ledger["first_step"],
        "last_step": ledger["last_step"],
        "finished": float(finished),
    }


@dataclasses.dataclass(frozen=True)
class Total:
    """The run's account over its attempts."""

    parts: dict[str, float]
    wall_s: float
    attempts: int
    recomputed_steps: int

    @classmethod
    def of(cls, records: list[dict]) -> Total:
        records = sorted(records, key=lambda r: r["attempt"])
        parts = {k: float(sum(r.get(k, 0.0) for r in records)) for k in PARTS}
        wall = records[-1]["end"] - records[0]["start"] if records else 0.0
        return cls(parts, wall, len(records), int(sum(r.get("recomputed_steps", 0) for r in records)))

    @property
    def goodput(self) -> float:
        return self.parts["step_s"] / self.wall_s if self.wall_s > 0 else 0.0

    def record(self) -> dict[str, float]:
        return {
            **{k: round(v, 6) for k, v in self.parts.items()},
            "wall_s": round(self.wall_s, 6),
            "goodput": round(self.goodput, 6),
            "attempts": float(self.attempts),
            "recomputed_steps": float(self.recomputed_steps),
        }

    def line(self) -> str:
        shown = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in self.parts.items() if v >= 0.05)
        return (
            f"goodput: {100 * self.goodput:.1f}% of {self.wall_s:.1f} s wall over {self.attempts} attempt(s) "
            f"({self.recomputed_steps} steps recomputed): {shown}"
        )

    def table(self) -> str:
        rows = [f"{'part':<14}{'seconds':>10}{'share':>9}"]
        for k, v in self.parts.items():
            share = v / self.wall_s if self.wall_s > 0 else 0.0
            rows.append(f"{k[:-2]:<14}{v:>10.2f}{100 * share:>8.1f}%")
        accounted = sum(self.parts.values())
        rows.append(f"{'sum of parts':<14}{accounted:>10.2f}{100 * accounted / max(self.wall_s, 1e-9):>8.1f}%")
        rows.append(f"{'wall':<14}{self.wall_s:>10.2f}")
        rows.append(
            f"goodput (step time / wall): {100 * self.goodput:.1f}%, attempts {self.attempts}, "
            f"steps recomputed {self.recomputed_steps}"
        )
        return "\n".join(rows)


def run_records(log_dir: str | os.PathLike) -> list[dict]:
    """Every attempt's account, from the ledgers in ``log_dir/goodput`` (each with its successor's start, restored
    step and the launcher's end), else from the ``goodput`` records of ``metrics.jsonl`` (ledgers deleted)."""
    from jddp import logs

    log_dir = Path(log_dir)
    paths = sorted((log_dir / LEDGER_DIR).glob("attempt-*.ledger"))
    if not paths:
        records = [r for r in logs.read_metrics(log_dir / logs.METRICS_FILE) if r.get("split") == "goodput"]
        return sorted(records, key=lambda r: r["attempt"])
    ledgers = [read(p) for p in paths]
    out = []
    for i, (path, ledger) in enumerate(zip(paths, ledgers, strict=True)):
        following = ledgers[i + 1] if i + 1 < len(ledgers) else None
        out.append(
            account(
                ledger,
                int(path.stem.split("-")[1]),
                next_start=following["attempt_start"] if following else None,
                next_first_step=int(following["first_step"]) if following else None,
                end=following["previous_end"] if following else None,
            )
        )
    return out


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
    parser.add_argument("--png", default=None, help="where to draw the chart (default RUN_DIR/goodput.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``jddp goodput RUN_DIR``: the run's account, and ``RUN_DIR/goodput.png``."""
    args = get_args_parser().parse_args(argv)
    run_dir = Path(args.run_dir)
    records = run_records(run_dir)
    if not records:
        print(
            f"jddp goodput: no goodput records or ledgers in {run_dir} (expected {run_dir}/metrics.jsonl and "
            f"{run_dir}/{LEDGER_DIR}/ from a jddp.fit run with log_dir={str(run_dir)!r})",
            flush=True,
        )
        return 2
    total = Total.of(records)
    for r in records:
        status = "finished" if r.get("finished") else "stopped"
        print(
            f"attempt {int(r['attempt'])}: steps {int(r['first_step'])}..{int(r['last_step'])} ({status}), "
            f"{r['end'] - r['start']:.1f} s, recomputed {int(r.get('recomputed_steps', 0))} steps"
        )
    print(total.table())
    png = Path(args.png) if args.png else run_dir / "goodput.png"
    plot(total, png)
    print(f"chart: {png}")
    return 0
