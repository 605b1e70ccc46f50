"""An attempt's goodput ledger: the small memory-mapped file process 0 of a ``fit`` writes after every step.

The file is ``SLOTS`` float64 values in order (``log_dir/goodput/<run>/attempt-NNNN.ledger``): a few stores to
memory per step, no system call, so an attempt that is SIGKILLed leaves it complete up to its last step. Here are
its writer (``Ledger``), its reader (``read``, ``ledger_accounts``), the mark that its account is written to
``metrics.jsonl`` (``close``) and ``jddp launch``'s mark of its end (``mark_teardown``, no NumPy). What the values
mean is ``jddp.goodput``'s module docstring; the arithmetic on them is ``jddp.goodput_accounts``.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import time
from pathlib import Path

from jddp import envvars, goodput_accounts, process_start, run_ids

# The ledger file's float64 slots, in file order.
SLOTS = (
    "attempt_start",
    "fit_start",
    *goodput_accounts.TIMERS,
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
_PROCESS_START = process_start.started()  # this process's start (jddp.process_start), without a launcher's
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

    def __init__(
        self, directory: Path, first_step: int, *, fit_start: float | None = None, restored_from: str | None = None
    ):
        """``directory``: the run's (``jddp.run_ids.run_dir``); ``fit_start``: when ``fit`` began (default now);
        ``restored_from``: ``"disk"``, ``"memory"``, ``"peer"`` (``jddp.Checkpointer.restored_from``) or None."""
        import numpy as np

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        run_ids.note_run(directory, directory.name)
        self.directory = directory
        self.run = directory.name
        self.index = len(list(directory.glob("attempt-*.ledger")))
        self.path = directory / f"attempt-{self.index:04d}.ledger"
        now = time.time()
        fit_start = now if fit_start is None else min(fit_start, now)
        start = _last_fit_end if _last_fit_end is not None else _env_time("JDDP_ATTEMPT_START") or _PROCESS_START
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
        for name in goodput_accounts.TIMERS:
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


def ledger_accounts(paths: list[Path]) -> list[dict[str, float]]:
    """``goodput_accounts.accounts`` of the ledgers at ``paths`` (``attempt-NNNN.ledger``, in order)."""
    return goodput_accounts.accounts([read(p) for p in paths], [int(p.stem.split("-")[1]) for p in paths])
