"""When this process started, by the wall clock: where a single process's goodput span begins.

``started()`` is the answer ``jddp.goodput_ledger`` takes when no launcher passed one (``$JDDP_ATTEMPT_START``):

* a script (``python train.py``): the process's start as the kernel recorded it, so that the interpreter's own
  start and every import before jddp's (JAX's alone takes seconds) are counted in ``startup_s``. On Linux it is
  read from ``/proc/self/stat`` (the start in clock ticks since boot, 10 ms) and turned into wall time through the
  boot clock (``CLOCK_BOOTTIME``), not through ``/proc/stat``'s ``btime``, which is whole seconds and moves with
  every correction of the wall clock since boot (psutil's ``create_time`` uses it). Elsewhere psutil's
  ``create_time`` where psutil is installed;
* an interactive session (a REPL, IPython or Jupyter: the kernel may have started hours before the run), or where
  neither source answers: when ``jddp`` was first imported (``IMPORTED_AT``, set by ``jddp/__init__.py``).

Imports no JAX.
"""

from __future__ import annotations

import os
import sys
import time

IMPORTED_AT = time.time()  # `import jddp` imports this module first: the latest start jddp can claim


def stat_start_ticks(stat: str) -> int:
    """The process's start (field 22, ``starttime``: clock ticks since boot) from a ``/proc/<pid>/stat`` line.

    The command name (field 2) is in parentheses and may itself hold spaces and parentheses, so the fields are
    counted after its last ``)``.

    Raises:
      ValueError: ``stat`` is not such a line.
    """
    _, paren, rest = stat.rpartition(")")
    fields = rest.split()
    if not paren or len(fields) < 20 or not fields[19].isdigit():
        raise ValueError(f"`stat` is not a /proc/<pid>/stat line with a start time in field 22: stat={stat[:200]!r}")
    return int(fields[19])


def _from_proc() -> float | None:
    """Linux: the start from ``/proc/self/stat`` and the boot clock, or None."""
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    if clock is None:
        return None
    try:
        with open("/proc/self/stat") as f:
            ticks = stat_start_ticks(f.read())
        age = time.clock_gettime(clock) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    return time.time() - age if age >= 0 else None


def _from_psutil() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    try:
        return float(psutil.Process().create_time())
    except Exception:  # psutil's own errors (AccessDenied, NoSuchProcess) share no base jddp can name
        return None


def interactive() -> bool:
    """A REPL (``python -i``, the plain prompt) or an IPython/Jupyter session."""
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or "IPython" in sys.modules


def started() -> float:
    """When this process's goodput span begins, in seconds since 1970 (see the module docstring)."""
    if interactive():
        return IMPORTED_AT
    start = _from_proc() or _from_psutil()
    return min(start, IMPORTED_AT) if start is not None else IMPORTED_AT
