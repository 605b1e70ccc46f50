"""Standby processes: the next attempt's group, started and ready before the failure that needs it.

Under ``jddp launch --max-restarts N`` on one node, the launcher keeps up to ``--standby-depth`` (default 2) of the next
attempts standing by, a *generation* each: once an attempt is past its first step (at once when it was itself woken from
standby and the next attempt has none yet), it starts the next attempt's coordination service and one spare per local
process (``jddp.cli.spare``), and hands each spare its role in that attempt at once, in *standby* (the role's
``JDDP_STANDBY_FD`` is the spare's socket to the launcher); the next generation follows once this one stands by, nearest
first. The script then runs as it would after a restart: ``jddp.initialize`` joins the next attempt's group (every
standby process of the node joins it), the model, optimizer, data loader and checkpointer are built, and ``jddp.fit``
compiles its step for the state and a batch of the loader (``DataParallel.compile``; the loader's position is put back).
Then, at the first thing that depends on the moment of the failure (``wait``: called by ``jddp.fit`` and
``Checkpointer.restore_or_init`` before they restore), the process tells its launcher it stands by (``STANDING_BY``) and
blocks.

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

Compiled before standing by, in any loop: at the first ``wait``, before it says ``STANDING_BY``, the process runs
the hooks registered with ``before_standing_by`` (in the order given), so that a hand-written loop's restart, too,
finds its step compiled (``jddp.engine.ahead``). ``DataParallel.init`` registers one: its step compiled for the
state it built and the batch of the training loader, and its ``eval_fn``'s program (only when the engine has an
``eval_fn``: the script defined an evaluation) for each other loader's batch; ``jddp.data_parallel`` registers
one that compiles the script's step where its arguments are known ahead (a step of one state argument and its
batches, the state given to the restore: ``restoring``). Each ``DataLoader`` offers its first batch
(``offer_batch``: read with its position left where it is, no collective); the training loader is the one
``jddp.fit`` or the restore names (``restoring``), else the first built. Nothing trains, no state changes and no
file is written before the wake: the hooks only trace and compile. A hook that raises ends the process before it
stands by (exit 1, its traceback on stderr: the launcher releases what it printed and the restart starts its
processes anew, where the same error, if it is one of the script's, comes out at the step's first call).
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from jddp import envvars
from jddp.handoff import ENV_STANDBY_FD, STANDING_BY, receive

# `restoring`, `restoring_state`, `batch_ahead`, `other_batches_ahead`: between jddp's own layers (the restore, fit,
# the engine's hooks), no public API.
__all__ = ["STANDING_BY", "active", "before_standing_by", "offer_batch", "on_wake", "wait"]

ENV_FD = ENV_STANDBY_FD
EXIT_NOT_READY = 1  # a hook before standing by raised: the standby ends, the restart starts the process anew
_on_wake: list[Callable[[], None]] = []
_before: list[Callable[[], None]] = []
_sources: list[tuple[Callable[[], Any], Callable[[], Any]]] = []  # weak references: the source, its loader
_train: list[Any] = []  # the training loader's weak reference, once named (``restoring``, ``jddp.fit``)
_restoring: list[Any] = []  # the state given to the restore (``restoring``), until the wake
_ahead: dict[int, tuple[Any, Any]] = {}  # the batches read for the hooks, while they run (their source kept)
_preparing: list[bool] = []  # non-empty while the hooks run
_MSG_WAIT_IN_HOOK = (
    "A hook registered with jddp.runtime.standby.before_standing_by called something that waits for the wake (a "
    "step, a restore, a save): a standby process must not train before it is woken. A hook only compiles "
    "(DataParallel.compile, jax.jit(...).lower(...).compile())."
)
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
    _check_callable("callback", callback)
    if active():
        _on_wake.append(callback)
    else:
        callback()


def before_standing_by(callback: Callable[[], None]) -> None:
    """In a standby process not yet woken: runs ``callback`` at the first ``wait``, before the process says it
    stands by (in the order given): what its restart would otherwise do after the wake (compile the step). It must
    not train, change a state or write a file. Elsewhere it is dropped: there is nothing to prepare.

    Raises:
      TypeError: ``callback`` is not callable.
    """
    _check_callable("callback", callback)
    if active():
        _before.append(callback)


def offer_batch(source: Callable[[], Any]) -> None:
    """In a standby process: ``source()`` gives one batch shaped as a loader's batches (its position left where it
    is), or None; the hooks before standing by compile for it (``batch_ahead``). A bound method is held weakly (a
    loader the script dropped is not kept alive, nor read). Elsewhere it is dropped.

    Raises:
      TypeError: ``source`` is not callable.
    """
    _check_callable("source", source)
    if not active():
        return
    if inspect.ismethod(source):
        _sources.append((weakref.WeakMethod(source), weakref.ref(source.__self__)))
    else:
        _sources.append((lambda: source, lambda: None))


def restoring(state: Any, loader: Any = None) -> None:
    """In a standby process, before the restore's ``wait``: the state the restore starts from (its shapes are the
    restored state's) and the training loader (the one whose batch the step is compiled for). ``jddp.fit`` and
    ``Checkpointer.restore_or_init`` call it; both are held until the wake. Elsewhere it does nothing."""
    if not active():
        return
    _restoring[:] = [state]
    _train[:] = [] if loader is None else [loader]


def restoring_state() -> Any:
    """The state given to ``restoring``, or None: what a script's own step (``jddp.data_parallel``) is compiled
    for."""
    return _restoring[0] if _restoring else None


def batch_ahead() -> Any:
    """While the hooks before standing by run: a batch of the training loader (the one given to ``restoring``,
    else the first built), read once for every hook; None when no loader offered one."""
    live = _live_sources()
    named = [source for source, owner in live if _train and owner is _train[0]]
    chosen = named[0] if named else live[0][0] if live else None
    if chosen is None:
        return None
    if id(chosen) not in _ahead:
        _ahead[id(chosen)] = (chosen, chosen())
    return _ahead[id(chosen)][1]


def other_batches_ahead() -> list[Any]:
    """While the hooks before standing by run: a batch of each other loader (an evaluation's), read once."""
    train = batch_ahead()
    out = []
    for source, _ in _live_sources():
        if id(source) not in _ahead:
            _ahead[id(source)] = (source, source())
        batch = _ahead[id(source)][1]
        if batch is not None and batch is not train:
            out.append(batch)
    return out


def _live_sources() -> list[tuple[Callable[[], Any], Any]]:
    live = []
    for ref, owner in _sources:
        source = ref()
        if source is not None:
            live.append((source, owner()))
    return live


def _check_callable(name: str, value: Any) -> None:
    if not callable(value):
        kind = type(value).__name__
        raise TypeError(f"`{name}` must be a function of no arguments, got {name}={value!r:.80} ({kind}).")


def _prepare() -> None:
    """Runs the hooks before standing by; one that raises ends the process (``EXIT_NOT_READY``), its traceback on
    stderr: a standby process that stands by must be ready, and its peers must not wait for it at a barrier."""
    hooks, _before[:] = list(_before), []
    try:
        for hook in hooks:
            hook()
    except Exception:
        sys.stdout.flush()
        print(
            "jddp: standby: preparing this process for the restart failed (the traceback follows); it ends before "
            "it stands by, and the restart starts the process anew",
            file=sys.stderr,
        )
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(EXIT_NOT_READY)  # no atexit hooks: the group's barrier would wait for peers that stand by
    finally:
        _ahead.clear()  # no batch kept on the devices while the process stands by


def wait() -> None:
    """In a standby process: runs the hooks registered with ``before_standing_by``, says ``STANDING_BY`` to the
    launcher and blocks until it sends the failure's moment (its environment variables are set, and the script
    goes on), or ends the standby (the process exits 0 at once). Elsewhere, and after the first call, returns at
    once.

    Raises:
      RuntimeError: called by a hook before standing by (it would train before the wake).
    """
    fd = _channel()
    if fd is None:
        return
    if _preparing:
        raise RuntimeError(_MSG_WAIT_IN_HOOK)
    _preparing.append(True)
    try:
        _prepare()
    finally:
        _preparing.clear()
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
    _sources.clear()
    _train.clear()
    _restoring.clear()
    callbacks, _on_wake[:] = list(_on_wake), []
    for callback in callbacks:
        callback()
