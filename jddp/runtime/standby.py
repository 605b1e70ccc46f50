"""Standby processes: the next attempt's group, started and ready before the failure that needs it.

Under ``jddp launch --max-restarts N`` on one node, once an attempt is past its first step, the launcher starts the
next attempt's coordination service and one spare per local process (``jddp.cli.spare``), and hands each spare its
role in the next attempt at once, in *standby* (the role's ``JDDP_STANDBY_FD`` is the spare's socket to the
launcher). The script then runs as it would after a restart: ``jddp.initialize`` joins the next attempt's group
(every standby process of the node joins it), the model, optimizer, data loader and checkpointer are built, and
``jddp.fit`` compiles its step for the state and a batch of the loader (``DataParallel.compile``; the loader's
position is put back). Then, at the first thing that depends on the moment of the failure (``wait``: called by
``jddp.fit`` and ``Checkpointer.restore_or_init`` before they restore), the process tells its launcher it stands by
(``STANDING_BY``) and blocks.

When the running attempt fails, the launcher stops it and sends each standby process the moment's environment
(``JDDP_ATTEMPT_START``, ``JDDP_PREVIOUS_END``: one line of JSON); the process takes it and goes on with the
restore, from the snapshots in memory that the failed attempt left. A restart then waits for neither Python's
start, nor the imports, nor the group's forming, nor the compilation: only for the failed group's end and the
restore. A launcher that ends the standby (the running attempt finished, or a standby peer died: its socket closed
without a line) ends the process at once, exit 0, without running the rest of the script; its output until then
is held by the launcher and dropped.

What runs before ``wait`` must not depend on when the failure came (it runs while the previous attempt still
trains): building the model and reading configs do not; a script that writes files before its restore writes them
early (``jddp.fit`` writes nothing before it). A script with a loop of its own and no ``restore_or_init`` stands by
at its first ``DataParallel.step``, which waits too: a standby process never trains. One that stands by nowhere
(it never reaches either) is ended when the failure comes, seeing no ``STANDING_BY``, and the attempt starts as
without standby processes.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable

from jddp import envvars
from jddp.handoff import ENV_STANDBY_FD, STANDING_BY, receive

__all__ = ["STANDING_BY", "active", "on_wake", "wait"]

ENV_FD = ENV_STANDBY_FD
_on_wake: list[Callable[[], None]] = []
_fd: list[int | None] = []  # JDDP_STANDBY_FD as read once (it is set only at a process's start); None once woken


def _channel() -> int | None:
    if not _fd:
        _fd.append(envvars.get(ENV_FD))
    return _fd[0]


def active() -> bool:
    """Whether this process is a standby process that has not been woken yet."""
    return _channel() is not None


def on_wake(callback: Callable[[], None]) -> None:
    """Runs ``callback`` when this standby process is woken, before ``wait`` returns (in the order given), or at
    once in any other process: what must not happen before the failure (``Checkpointer`` takes its directory's
    lease there).

    Raises:
      TypeError: ``callback`` is not callable.
    """
    if not callable(callback):
        raise TypeError(
            f"`callback` must be a function of no arguments, got callback={callback!r} ({type(callback).__name__})."
        )
    if active():
        _on_wake.append(callback)
    else:
        callback()


def wait() -> None:
    """In a standby process: says ``STANDING_BY`` to the launcher and blocks until it sends the failure's moment
    (its environment variables are set, and the script goes on), or ends the standby (the process exits 0 at once).
    Elsewhere, and after the first call, returns at once."""
    fd = _channel()
    if fd is None:
        return
    _fd[0] = None
    os.environ.pop(ENV_FD, None)  # not inherited by what the script starts
    channel = socket.socket(fileno=fd)
    try:
        channel.sendall(STANDING_BY)
        message = receive(channel)
    except OSError:
        message = None
    finally:
        channel.close()
    if message is None:  # not needed: the attempt it stood by for ended without a failure, or a peer died
        sys.stdout.flush()
        os._exit(0)  # no atexit hooks: the group's barrier and the checkpointer's close would wait for peers
    os.environ.update(message["env"])
    callbacks, _on_wake[:] = list(_on_wake), []
    for callback in callbacks:
        callback()
