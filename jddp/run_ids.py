"""The runs in a ``log_dir``: their ids, their folders and ``run.json``, and which run a ``fit`` belongs to.

The rules of what makes a run, and what continues one, are ``jddp.goodput``'s (its module docstring). Each run has
a folder ``log_dir/goodput/<run>/`` holding its ``run.json`` (the id, its creation time and the launchers that ran
it) and its attempts' ledgers (``jddp.goodput_ledger``). ``jddp.logs`` (``check_other_runs``) and
``jddp.goodput`` both read them from here; this module imports nothing of either.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path

from jddp import envvars

LEDGER_DIR = "goodput"
RUN_FILE = "run.json"  # in each run's folder: {"run": id, "created": time, "launchers": [$JDDP_RUN_START, ...]}


def new_run_id() -> str:
    """A new run's id: its start in UTC and 4 random hex digits (sorts by start to the second; ``runs`` orders by
    ``run.json``'s creation time, which tells apart two runs started within one second)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def run_dir(log_dir: str | os.PathLike, run: str) -> Path:
    """Where run ``run``'s ledgers are: ``log_dir/goodput/<run>``."""
    return Path(log_dir) / LEDGER_DIR / run


def run_info(log_dir: str | os.PathLike, run: str) -> dict:
    """The run's ``run.json`` (``{}`` when missing, unreadable or not what jddp writes)."""
    return _read_info(run_dir(log_dir, run) / RUN_FILE)


def _read_info(path: Path) -> dict:
    """``run.json`` as jddp writes it (an object with a finite ``created`` and a list of ``launchers``), else ``{}``:
    a file damaged or edited by hand is ignored, never a Python error (the run is then chosen as if it had none)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(info, dict):
        return {}
    created, launchers = info.get("created"), info.get("launchers")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        return {}
    if not isinstance(launchers, list):
        return {}
    return info


def runs(log_dir: str | os.PathLike) -> list[str]:
    """The runs with ledgers in ``log_dir``, oldest first."""
    base = Path(log_dir) / LEDGER_DIR
    if not base.is_dir():
        return []
    found = [p.name for p in base.iterdir() if p.is_dir() and any(p.glob("attempt-*.ledger"))]
    return sorted(found, key=lambda r: (run_info(log_dir, r).get("created", math.inf), r))


def choose_run(log_dir: str | os.PathLike, resumed: str | None) -> tuple[str, str]:
    """The run a ``fit`` into ``log_dir`` belongs to, and why (the rules of ``jddp.goodput``'s module docstring).

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


def note_run(directory: Path, run: str) -> None:
    """Writes (or extends) the run's ``run.json``: its id, creation time and the launcher running it."""
    path = directory / RUN_FILE
    info = _read_info(path) or {"run": run, "created": time.time(), "launchers": []}
    launcher = envvars.get("JDDP_RUN_START")
    if launcher is not None and launcher not in info["launchers"]:
        info["launchers"].append(launcher)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
