"""Survivors flush before they die: what a process writes out when its launcher ends it for a restart.

When one process of a group fails and a restart follows, ``jddp launch`` ends the others at once: waiting for
them to notice would be downtime. A plain SIGKILL would lose whatever they had buffered: a ``metrics.jsonl`` the
script opened, a logger's last lines, ``sys.stdout`` when it is a file. So the launcher first sends
``FLUSH_SIGNAL`` (SIGUSR2) to each survivor's session, and SIGKILL only ``--flush-grace`` seconds later (1 s by
default) to those still running.

Under ``jddp launch``, ``jddp.initialize()`` installs the handler (``install``). On that signal the process flushes,
newest first, every file object or callable given to ``register_flush``, then every handler of Python's
``logging`` (``logging.shutdown``: a ``FileHandler`` writes its buffer out), then ``sys.stdout`` and
``sys.stderr``, and exits at once with ``os._exit(128 + FLUSH_SIGNAL)``: no ``atexit`` hook, no ``finally``, no
wait for its peers (the group is being restarted). It works while the main thread is blocked in native code (a
collective waiting for a peer that is gone): Python runs a signal handler only on the main thread between bytecodes,
so the C-level handler's byte on ``signal.set_wakeup_fd``'s pipe wakes a thread of jddp's (``jddp-flush``) that
flushes instead. Whichever of the two comes first flushes; the other waits for the exit.

What a user's own writer must do: a file object or a ``flush()``-able writer of the script's own (a JSONL file, a
CSV writer's file, a TensorBoard writer) goes to ``register_flush``; so does a callable that drains a queue of its
own (a ``logging.handlers.QueueListener``'s ``stop``). Handlers of the ``logging`` module need nothing. A write
that the signal interrupts half done may leave a partial last line: read such files tolerating one.

Bounds: the flushes run while the launcher waits ``--flush-grace`` seconds; a flush that takes longer (a hung
network filesystem, a lock the main thread holds forever) is cut short by SIGKILL and its data is lost. A process
stopped (SIGSTOP) or holding the GIL in C code flushes nothing before the SIGKILL. Outside ``jddp launch`` nothing
is installed and SIGUSR2 keeps its meaning.

Example:
  >>> import io
  >>> buffer = io.StringIO()
  >>> register_flush(buffer)  # flushed if the launcher ends this process for a restart
  >>> register_flush("metrics.jsonl")
  Traceback (most recent call last):
  TypeError: `register_flush(f)` takes a file object or a callable, got f='metrics.jsonl' (a str): pass the open ...
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import IO, Any

from jddp import envvars

FLUSH_SIGNAL = signal.SIGUSR2  # what jddp.cli.launch sends before SIGKILL (jddp.cli.launch.workers)
EXIT_CODE = 128 + FLUSH_SIGNAL  # how a process ends after it flushed

_registered: list[Callable[[], Any]] = []
_last: list[Callable[[], Any]] = []  # jddp's own writes of state (at_flush), after every stream is flushed
_exiting = threading.Lock()  # taken once, by whichever of the handler and the thread flushes first
_installed = False


def register_flush(f: IO[Any] | Callable[[], Any]) -> None:
    """Flushes ``f`` when ``jddp launch`` ends this process for a restart (see the module docstring).

    Args:
      f: an open file object (anything with a ``flush`` method), or a callable of no arguments that writes out
        what its writer has buffered. Registered ones are flushed newest first, before ``logging``'s handlers and
        ``sys.stdout``.

    Raises:
      TypeError: ``f`` is neither.
    """
    flush = getattr(f, "flush", None)
    if callable(flush):
        _registered.append(flush)
        return
    if not callable(f) or isinstance(f, (str, bytes, os.PathLike)):
        how = "the open file (f = open(path, 'a'); register_flush(f)), not its name" if isinstance(
            f, (str, bytes, os.PathLike)
        ) else "an object with a flush() method, or a function of no arguments"  # fmt: skip
        raise TypeError(
            f"`register_flush(f)` takes a file object or a callable, got f={f!r} (a {type(f).__name__}): pass {how}."
        )
    _registered.append(f)


def at_flush(write: Callable[[], Any]) -> None:
    """jddp's own: ``write`` runs at the flush, after every stream (``jddp.checkpoint.snapshot``'s kept step: a
    state's write takes longer than a line's, and the lines come first); ``forget`` removes it."""
    _last.append(write)


def forget(write: Callable[[], Any]) -> None:
    """Removes what ``at_flush`` was given (a closed ``Checkpointer``'s)."""
    with contextlib.suppress(ValueError):
        _last.remove(write)


def flush_all() -> None:
    """Flushes what ``register_flush`` was given (newest first), ``logging``'s handlers, ``sys.stdout`` and
    ``sys.stderr``, then runs jddp's own writes (``at_flush``); an error in one is ignored, the others still run."""
    for flush in reversed(_registered):
        with contextlib.suppress(Exception):
            flush()
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    for write in list(_last):
        with contextlib.suppress(Exception):
            write()


def _flush_and_exit() -> None:
    _exiting.acquire()  # the second caller waits here for the first one's exit
    flush_all()
    os._exit(EXIT_CODE)


def _on_signal(signum: int, frame: object) -> None:
    _flush_and_exit()


def _watch(read_fd: int, previous_fd: int) -> None:
    """The ``jddp-flush`` thread: reads the signal numbers that Python's C-level handler writes to the wakeup fd;
    flushes on ``FLUSH_SIGNAL``, passes every other number on to the wakeup fd set before (asyncio's, if any)."""
    while True:
        try:
            data = os.read(read_fd, 512)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        if FLUSH_SIGNAL in data:
            _flush_and_exit()
        if previous_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(previous_fd, bytes(b for b in data if b != FLUSH_SIGNAL))


def install() -> bool:
    """Under ``jddp launch`` (``$JDDP_LEDGER_NOTE`` set, as for its processes only), from the main thread: the
    handler of ``FLUSH_SIGNAL`` and the ``jddp-flush`` thread; returns whether they are installed (once per
    process; not outside the launcher, not from another thread)."""
    global _installed
    if _installed:
        return True
    if not envvars.get("JDDP_LEDGER_NOTE") or threading.current_thread() is not threading.main_thread():
        return False
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        signal.signal(FLUSH_SIGNAL, _on_signal)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(read_fd)
        os.close(write_fd)
        return False
    threading.Thread(target=_watch, args=(read_fd, previous), name="jddp-flush", daemon=True).start()
    _installed = True
    return True
