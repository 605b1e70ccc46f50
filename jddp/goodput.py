"""Goodput: where a run's wall time went, across its restarts; and ``jddp goodput``, which reports it.

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
  (``$JDDP_ATTEMPT_START``), else the process's own start (``jddp.process_start``:
  the kernel's record; in a REPL or notebook, when ``jddp`` was first imported),
  or, for a second ``fit`` in one process, the first one's end.
* ``restore_s``: ``restore_or_init``. ``compile_s``: the first step.
* ``step_s``: training steps, the productive time (less ``recomputed_s``).
* ``data_wait_s``, ``checkpoint_s`` (blocking time of saves), ``eval_s``.
* ``other_s``: ``fit``'s remaining time (logging, replica checks, the plot).
* ``recomputed_s``: steps this attempt took that the next one took again
  after restoring an older checkpoint (``recomputed_steps`` of them), at this
  attempt's mean time per step; moved out of ``step_s`` and ``data_wait_s``.
  A step counts as taken once it is known complete: at each step, the newest
  one whose outputs were ready (``dispatch.Dispatcher.unfinished``); a step
  still running on the devices when the failure came produced nothing. The
  count may lag the devices by up to ``max_inflight`` steps completed after
  the attempt's last step.
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

**The modules.** This one reads a run's accounts back (``run_records``) and
reports them (``main``: ``jddp goodput``; ``plot``); it also re-exports the
names of the pieces, each in a module of its own: the runs of a ``log_dir``
and which one a ``fit`` belongs to (``jddp.run_ids``), the ledger file
(``jddp.goodput_ledger``) and the arithmetic of the accounts
(``jddp.goodput_accounts``).
"""

from __future__ import annotations

import os
from pathlib import Path

from jddp import goodput_accounts, goodput_ledger, logs, run_ids

# Re-exported (`X as X`): the names this module held before the ledger, the accounts and the runs moved to modules
# of their own; no `__all__`, as before the split (docs/api.md documents the public ones).
from jddp.goodput_accounts import CUT_FIRST as CUT_FIRST
from jddp.goodput_accounts import PARTS as PARTS
from jddp.goodput_accounts import TEARDOWN as TEARDOWN
from jddp.goodput_accounts import TIMERS as TIMERS
from jddp.goodput_accounts import Total as Total
from jddp.goodput_accounts import account as account
from jddp.goodput_accounts import accounts as accounts
from jddp.goodput_ledger import RESTORED_FROM as RESTORED_FROM
from jddp.goodput_ledger import SLOTS as SLOTS
from jddp.goodput_ledger import Ledger as Ledger
from jddp.goodput_ledger import close as close
from jddp.goodput_ledger import ledger_accounts as ledger_accounts
from jddp.goodput_ledger import mark_teardown as mark_teardown
from jddp.goodput_ledger import read as read
from jddp.run_ids import LEDGER_DIR as LEDGER_DIR
from jddp.run_ids import RUN_FILE as RUN_FILE
from jddp.run_ids import choose_run as choose_run
from jddp.run_ids import new_run_id as new_run_id
from jddp.run_ids import run_dir as run_dir
from jddp.run_ids import run_info as run_info
from jddp.run_ids import runs as runs


def run_records(log_dir: str | os.PathLike, run: str | None = None) -> list[dict]:
    """Every attempt's account of run ``run`` (default the newest), from its ledgers in ``log_dir/goodput/<run>``,
    else from the run's ``goodput`` records of ``metrics.jsonl`` (ledgers deleted).

    Raises:
      goodput_ledger.DamagedLedgerError: a ledger or ``metrics.jsonl`` is damaged (named; nothing is changed).
    """
    log_dir = Path(log_dir)
    known = run_ids.runs(log_dir)
    run = run if run is not None else (known[-1] if known else None)
    paths = sorted(run_ids.run_dir(log_dir, run).glob("attempt-*.ledger")) if run else []
    if paths:
        return goodput_ledger.ledger_accounts(paths)
    metrics = log_dir / logs.METRICS_FILE
    try:
        records = [r for r in logs.read_metrics(metrics) if isinstance(r, dict) and r.get("split") == "goodput"]
    except (OSError, UnicodeDecodeError) as e:
        raise goodput_ledger.DamagedLedgerError(metrics, f"it cannot be read ({e})", what="goodput log") from None
    if run is None and records:
        run = records[-1].get("run")
    return goodput_ledger.check_records([r for r in records if r.get("run") == run], metrics)


def plot(total: goodput_accounts.Total, path: Path) -> None:
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
    known = run_ids.runs(log_dir)
    if args.run is not None and args.run not in known:
        listed = ", ".join(known) or "none"
        print(f"jddp goodput: no run {args.run!r} in {log_dir} (--run takes one of: {listed})", flush=True)
        return 2
    try:
        records = run_records(log_dir, args.run)
    except goodput_ledger.DamagedLedgerError as e:  # named, exit 2: never a report built from a damaged file
        print(f"jddp goodput: {e}", flush=True)
        return 2
    if not records:
        print(
            f"jddp goodput: no goodput records or ledgers in {log_dir} (expected {log_dir}/metrics.jsonl and "
            f"{log_dir}/{run_ids.LEDGER_DIR}/ from a jddp.fit run with log_dir={str(log_dir)!r})",
            flush=True,
        )
        return 2
    run = args.run or (known[-1] if known else str(records[-1].get("run", "")))
    if len(known) > 1:
        print(f"runs in {log_dir}, oldest first: {', '.join(known)} (showing {run}; --run to choose)")
    total = goodput_accounts.Total.of(records, run)
    for r in records:
        status = "finished" if r.get("finished") else "stopped"
        source = goodput_ledger.RESTORED_FROM[int(r.get("restored_from", 0))]
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
