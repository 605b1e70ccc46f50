"""An attempt's goodput ledger: the small memory-mapped file process 0 of a ``fit`` writes after every step.

The file is ``SLOTS`` float64 values in order (``log_dir/goodput/<run>/attempt-NNNN.ledger``): a few stores to
memory per step, no system call, so an attempt that is SIGKILLed leaves it complete up to its last step. Here are
its writer (``Ledger``), its reader (``read``, ``ledger_accounts``), the mark that its account is written to
``metrics.jsonl`` (``close``) and ``jddp launch``'s mark of its end (``mark_teardown``, no NumPy). What the values
mean is ``jddp.goodput``'s module docstring; the arithmetic on them is ``jddp.goodput_accounts``.

**Read defensively.** The first three slots say what the file is: its ``format`` (``FORMAT``), the ``run`` it belongs
to (the CRC-32 of its folder's name, the run id) and its ``attempt`` (the number in its name); every slot holds a
value of its ``DOMAINS`` (times finite and after 1970, seconds and steps finite and not negative, counts whole). A
file that is not that (cut short, a folder, another format, another run's or attempt's, NaN, infinite or negative
fields, bytes of something else) is damaged: ``read`` raises ``DamagedLedgerError`` naming it. ``fit`` (the writer)
sets such a file aside as ``<name>.damaged`` with a warning naming it and goes on (``usable``); ``jddp goodput``
(a report) refuses with the file named and exit 2. Ledgers written before the header (``LEGACY_SLOTS``, the last
``_ADDED_SLOTS`` optional) are still read, with the same checks of their values.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import time
import warnings
import zlib
from pathlib import Path

from jddp import envvars, goodput_accounts, process_start, run_ids

FORMAT = 2  # the layout of SLOTS; a ledger without the header (LEGACY_SLOTS) is format 1
# The ledger file's float64 slots, in file order.
SLOTS = (
    "format",  # FORMAT
    "run",  # zlib.crc32 of the run's id (its folder's name): a ledger copied into another run's folder is refused
    "attempt",  # the number in the file's name (attempt-NNNN.ledger)
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
LEGACY_SLOTS = SLOTS[3:]  # format 1: the same slots without the header
# Slots that format 1 ledgers may lack (written before them): read as 0, or 1 process.
_ADDED_SLOTS = ("restored_from", "processes", "nodes", "round")
_LATEST = 2.0**33  # no time or duration of a run reaches this (the year 2242; 272 years of seconds)
# What each slot may hold, by domain: read() refuses a ledger with any value outside its slot's domain.
DOMAIN_RULES = {
    "format": "the number FORMAT",
    "run": "the CRC-32 of the folder's name",
    "attempt": "the number in the file's name",
    "time": f"a time (seconds since 1970, above 0 and below {_LATEST:.0f})",
    "time or 0": "a time, or 0 (not yet)",
    "time or nan": "a time, or NaN (not known)",
    "seconds": f"a duration in seconds (0 or more, below {_LATEST:.0f})",
    "whole": "a whole number (0 or more, below 2**53)",
    "positive whole": "a whole number (1 or more, below 2**53)",
    "flag": "0 or 1",
    "restored_from": "an index of RESTORED_FROM",
}
DOMAINS = {
    "format": "format",
    "run": "run",
    "attempt": "attempt",
    "attempt_start": "time",
    "fit_start": "time",
    **dict.fromkeys(goodput_accounts.TIMERS, "seconds"),
    "first_step": "whole",
    "last_step": "whole",
    "steps_run": "whole",
    "last_update": "time",
    "end": "time or 0",
    "previous_end": "time or nan",
    "closed": "flag",
    "teardown_end": "time or 0",
    "first_step_end": "time or 0",
    "restored_from": "restored_from",
    "processes": "positive whole",
    "nodes": "whole",
    "round": "whole",
}
# Where an attempt's state came from (the "restored_from" slot): jddp.Checkpointer.restored_from.
RESTORED_FROM = ("none", "disk", "memory", "peer")
_PROCESS_START = process_start.started()  # this process's start (jddp.process_start), without a launcher's
_last_fit_end: float | None = None  # a second fit in the same process starts its attempt here
DAMAGED_SUFFIX = ".damaged"  # a damaged ledger set aside: attempt-NNNN.ledger.damaged


class DamagedLedgerError(ValueError):
    """A file that is not a readable goodput ledger of this run (``read``), or a ``metrics.jsonl`` whose
    ``goodput`` records are not accounts (``check_records``); ``path`` names it."""

    def __init__(self, path: Path, why: str, *, what: str = "goodput ledger"):
        self.path = Path(path)
        super().__init__(
            f"{self.path} is not a usable {what}: {why}. It was cut short, overwritten or copied from elsewhere; "
            f"move it out of {self.path.parent} to report the run without it."
        )


def run_key(run: str) -> float:
    """The ``run`` slot's value for run id ``run`` (its CRC-32: a whole number, exact in a float64)."""
    return float(zlib.crc32(run.encode("utf-8", "surrogateescape")))


def attempt_number(path: Path) -> int | None:
    """The ``NNNN`` of ``attempt-NNNN.ledger`` (or of ``attempt-NNNN.ledger.damaged``), else None."""
    stem = Path(path).name.split(".", 1)[0]
    number = stem.removeprefix("attempt-")
    return int(number) if stem.startswith("attempt-") and number.isdigit() else None


def _whole(v: float, least: int) -> bool:
    return math.isfinite(v) and v == int(v) and least <= v < 2.0**53


def _time(v: float) -> bool:
    return math.isfinite(v) and 0.0 < v < _LATEST


def in_domain(domain: str, value: float, *, run: float = math.nan, attempt: float = math.nan) -> bool:
    """Whether ``value`` is one of ``DOMAIN_RULES[domain]``'s (``run``, ``attempt``: the values the header must
    hold)."""
    if domain == "format":
        return value == FORMAT
    if domain in ("run", "attempt"):
        return value == (run if domain == "run" else attempt)
    if domain == "time":
        return _time(value)
    if domain == "time or 0":
        return value == 0.0 or _time(value)
    if domain == "time or nan":
        return math.isnan(value) or _time(value)
    if domain == "seconds":
        return math.isfinite(value) and 0.0 <= value < _LATEST
    if domain == "whole":
        return _whole(value, 0)
    if domain == "positive whole":
        return _whole(value, 1)
    if domain == "flag":
        return value in (0.0, 1.0)
    if domain == "restored_from":
        return _whole(value, 0) and value < len(RESTORED_FROM)
    raise ValueError(f"no ledger domain {domain!r} (expected one of {sorted(DOMAIN_RULES)})")


def _env_time(name: str) -> float | None:
    """A time the launcher passed (``JDDP_ATTEMPT_START``, ``JDDP_PREVIOUS_END``), parsed by ``jddp.envvars``."""
    return envvars.get(name)


def _is_current_ledger(path: Path) -> bool:
    """Whether ``path`` is a file of this format's size, named as a ledger, whose header says this format."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = os.pread(f.fileno(), 8, 0)
    except OSError:
        return False
    named = attempt_number(path) is not None and path.name.endswith(".ledger")
    return named and size == 8 * len(SLOTS) and struct.unpack("<d", head)[0] == FORMAT


def mark_teardown(note: str | os.PathLike) -> None:
    """``jddp launch``, at its end: writes the time into the ledger whose path process 0 wrote in ``note``
    (imports no NumPy or JAX). A note that names no ledger of this format is left alone: nothing is written."""
    try:
        path = Path(Path(note).read_text().strip())
        if not _is_current_ledger(path):
            return  # the note was cut short or names something else: never write into a file that is no ledger
        read(path)  # every slot in its domain, else DamagedLedgerError (a ValueError): left as it is
        with open(path, "r+b") as f:
            os.pwrite(f.fileno(), struct.pack("<d", time.time()), 8 * SLOTS.index("teardown_end"))
    except (OSError, ValueError):
        pass  # no fit with a log_dir ran, or its directory is gone: nothing to account


def set_aside(path: Path, error: DamagedLedgerError) -> Path:
    """Renames a damaged ledger to ``<name>.damaged`` (a free name) with a warning naming both; returns the new
    path."""
    target = path.with_name(path.name + DAMAGED_SUFFIX)
    n = 0
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}.{n}")
    os.replace(path, target)
    warnings.warn(
        f"{error} The goodput account goes on without it: set aside as {target}.", RuntimeWarning, stacklevel=3
    )
    return target


def usable(paths: list[Path]) -> list[Path]:
    """``paths`` that ``read`` accepts; each damaged one is set aside (``set_aside``) with a warning naming it."""
    kept = []
    for path in paths:
        try:
            read(path)
        except DamagedLedgerError as e:
            set_aside(path, e)
        else:
            kept.append(path)
    return kept


class Ledger:
    """This attempt's ledger (process 0 of a ``fit`` with a ``log_dir``); see the module docstring."""

    def __init__(
        self, directory: Path, first_step: int, *, fit_start: float | None = None, restored_from: str | None = None
    ):
        """``directory``: the run's (``jddp.run_ids.run_dir``); ``fit_start``: when ``fit`` began (default now);
        ``restored_from``: ``"disk"``, ``"memory"``, ``"peer"`` (``jddp.Checkpointer.restored_from``) or None.
        Earlier attempts' damaged ledgers are set aside first (``usable``), with a warning naming each."""
        import numpy as np

        if restored_from is not None and restored_from not in RESTORED_FROM:
            raise ValueError(
                f"`restored_from` must be None or one of {RESTORED_FROM}, got restored_from={restored_from!r}"
            )
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        usable(sorted(directory.glob("attempt-*.ledger")))
        run_ids.note_run(directory, directory.name)
        self.directory = directory
        self.run = directory.name
        # after every attempt's file, those set aside included: a new ledger never takes a damaged one's number
        taken = [attempt_number(p) for p in directory.glob("attempt-*")]
        self.index = max([n for n in taken if n is not None], default=-1) + 1
        self.path = directory / f"attempt-{self.index:04d}.ledger"
        now = time.time()
        fit_start = now if fit_start is None else min(fit_start, now)
        start = _last_fit_end if _last_fit_end is not None else _env_time("JDDP_ATTEMPT_START") or _PROCESS_START
        previous_end = _env_time("JDDP_PREVIOUS_END") if _last_fit_end is None else None
        values: dict[str, float] = dict.fromkeys(SLOTS, 0.0)
        values["format"], values["run"], values["attempt"] = float(FORMAT), run_key(self.run), float(self.index)
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
        if note:  # tell jddp launch where to write its end (teardown_s); whole or not at all (a launcher reads it)
            with contextlib.suppress(OSError):
                note_tmp = Path(f"{note}.tmp")
                note_tmp.write_text(str(self.path.resolve()))
                os.replace(note_tmp, note)

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
        """The accounts of this run's earlier attempts not yet in ``metrics.jsonl``, each with its ledger's path
        (damaged ledgers set aside, with a warning naming each)."""
        paths = usable(sorted(self.directory.glob("attempt-*.ledger")))
        accounts = ledger_accounts(paths)
        return [(p, a) for p, a in zip(paths, accounts, strict=True) if p != self.path and not read(p)["closed"]]


def _values(path: Path) -> list[float]:
    """The file's float64 values, or ``DamagedLedgerError`` naming what is wrong with its bytes."""
    path = Path(path)
    try:
        if path.stat().st_size > 8 * len(SLOTS):  # not read into memory: no ledger is longer
            raise DamagedLedgerError(path, f"its {path.stat().st_size} bytes are more than a ledger's {8 * len(SLOTS)}")
        data = path.read_bytes()
    except IsADirectoryError:
        raise DamagedLedgerError(path, "it is a directory, not a file") from None
    except OSError as e:
        raise DamagedLedgerError(path, f"it cannot be read ({e.strerror or e})") from None
    if not data or len(data) % 8:
        raise DamagedLedgerError(path, f"its {len(data)} bytes are not a whole number of 8-byte slots (cut short)")
    return list(struct.unpack(f"<{len(data) // 8}d", data))  # struct, not NumPy: the launcher reads it too


def read(path: Path) -> dict[str, float]:
    """The ledger's values by slot name (``SLOTS``; a format 1 ledger's header is filled in).

    Raises:
      DamagedLedgerError: the file is not a ledger of this run in a format this jddp reads, or a slot holds a
        value outside its ``DOMAINS`` (the error names the file, the slot and the value).
    """
    path = Path(path)
    values = _values(path)
    attempt = attempt_number(path)
    expected = {"run": run_key(path.parent.name), "attempt": math.nan if attempt is None else float(attempt)}
    if values[0] == FORMAT:
        if len(values) != len(SLOTS):
            raise DamagedLedgerError(
                path, f"it holds {len(values)} slots, format {FORMAT} has {len(SLOTS)} (cut short)"
            )
        found: dict[str, float] = dict(zip(SLOTS, values, strict=True))
    elif _whole(values[0], 0) and values[0] < 1000:  # a format number this jddp does not know (a time is > 1e9)
        why = f"its `format` slot says format={values[0]:.0f}; this jddp writes format {FORMAT} (and reads format 1)"
        raise DamagedLedgerError(path, why)
    else:  # format 1, without the header; it may lack the last slots (written before them)
        missing = len(LEGACY_SLOTS) - len(values)
        if not 0 <= missing <= len(_ADDED_SLOTS):
            raise DamagedLedgerError(
                path, f"its first slot {values[0]!r} is not format {FORMAT} and its {len(values)} slots no format 1"
            )
        legacy = [*values, *(1.0 if k == "processes" else 0.0 for k in LEGACY_SLOTS[len(values) :])]
        found = {"format": float(FORMAT), **expected, **dict(zip(LEGACY_SLOTS, legacy, strict=True))}
    for name in SLOTS:
        if not in_domain(DOMAINS[name], found[name], **expected):
            rule = DOMAIN_RULES[DOMAINS[name]]
            if name in expected:
                rule = f"{rule}, {expected[name]:.0f}"
            raise DamagedLedgerError(path, f"its slot `{name}` holds {name}={found[name]!r}, expected {rule}")
    return found


def close(path: Path) -> None:
    """Marks a ledger's account as written to ``metrics.jsonl`` (a ledger ``read`` accepted, of either format)."""
    layout = SLOTS if _is_current_ledger(Path(path)) else LEGACY_SLOTS
    with open(path, "r+b") as f:
        os.pwrite(f.fileno(), struct.pack("<d", 1.0), 8 * layout.index("closed"))


def ledger_accounts(paths: list[Path]) -> list[dict[str, float]]:
    """``goodput_accounts.accounts`` of the ledgers at ``paths`` (``attempt-NNNN.ledger``, in order).

    Raises:
      DamagedLedgerError: one of them is damaged (``read``); ``usable`` sets such ledgers aside first.
    """
    return goodput_accounts.accounts([read(p) for p in paths], [attempt_number(p) or 0 for p in paths])


# What a ``goodput`` record of metrics.jsonl (an account: goodput_accounts.account) holds, by the domains of DOMAINS;
# the fields ``jddp goodput`` needs are required, the others were added later and default as account's .get does.
RECORD_DOMAINS = {
    "attempt": "whole",
    "start": "time",
    "end": "time",
    **dict.fromkeys(goodput_accounts.PARTS, "seconds"),
    "first_step": "whole",
    "last_step": "whole",
}
OPTIONAL_RECORD_DOMAINS = {
    goodput_accounts.TEARDOWN: "seconds",
    "recomputed_steps": "whole",
    "steps": "whole",
    "finished": "flag",
    "restored_from": "restored_from",
    "processes": "positive whole",
    "nodes": "whole",
    "round": "whole",
}


def check_records(records: list[dict], path: Path) -> list[dict]:
    """The ``goodput`` records of one run read from ``path`` (``metrics.jsonl``), one per attempt (a record written
    again by the next attempt, after a kill between the write and ``close``, counts once: the last).

    Raises:
      DamagedLedgerError: a record lacks a field ``RECORD_DOMAINS`` requires, or holds a value outside its domain
        (not a number, NaN, infinite, negative, not whole), or ends before it starts; the error names the file, the
        attempt and the field.
    """
    by_attempt: dict[float, dict] = {}
    for record in records:
        shown = f"the goodput record of attempt {record.get('attempt')!r}"
        for name, domain in {**RECORD_DOMAINS, **OPTIONAL_RECORD_DOMAINS}.items():
            if name not in record and name in OPTIONAL_RECORD_DOMAINS:
                continue
            value = record.get(name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not in_domain(domain, float(value)):
                why = f"{shown} holds {name}={value!r}, expected {DOMAIN_RULES[domain]}"
                raise DamagedLedgerError(path, why, what="goodput log")
        if record["end"] < record["start"]:
            why = f"{shown} ends (end={record['end']!r}) before it starts (start={record['start']!r})"
            raise DamagedLedgerError(path, why, what="goodput log")
        by_attempt[float(record["attempt"])] = record
    return [by_attempt[k] for k in sorted(by_attempt)]
