"""A ``Checkpointer``'s life: the state its parts share, the write in flight and its errors, ``wait``, ``close``, exit.

``jddp.checkpoint.checkpointer`` builds ``Checkpointer`` from three parts that share one state (one Orbax manager,
its writer thread and the step bookkeeping): this base, the save path (``jddp.checkpoint.saving``) and the restore
path (``jddp.checkpoint.restoring``). The base holds what both paths use: the wrappers of the methods that take a
state, the check that it is open, the steps on disk, the hand-over to Orbax joined and a failed write turned into
one ``CheckpointError``, and the end of its life (``wait``, ``close``, a ``with`` block, and the exit hook that
finishes one a script left open). The attributes declared on ``Lifecycle`` are that shared state;
``Checkpointer.__init__`` sets them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import sys
import time
import weakref
from typing import Any, Self

import jax
import orbax.checkpoint as ocp

from jddp.checkpoint import any_tree, lease, orbax_io, preemption, snapshot, storage
from jddp.checkpoint.errors import CheckpointError
from jddp.runtime import memory, progress, standby, watchdog


def accepts_any_tree(method):
    """A state of the user's own (any pytree of arrays: a Flax ``TrainState``, an Equinox model and its optimizer
    state) taken where a ``TrainState`` is, with ``step=`` or its own ``step``; ``restore_or_init`` gives back a tree
    of the same kind (``jddp.checkpoint.any_tree``). It is one frame more between the user and every warning of
    these methods: their ``stacklevel``s count it."""

    @functools.wraps(method)
    def wrapper(self, state, *args, step=None, **kwargs):
        if method.__name__ == "restore_or_init":  # a standby process compiles for them (jddp.engine.ahead)
            standby.restoring(state, args[0] if args else kwargs.get("loader"))
        if not any_tree.is_foreign(state):
            if step is not None:
                raise TypeError(
                    f"`step` is for a state of your own (any pytree), but state is a jddp.TrainState, which carries "
                    f"its step: drop step={step!r}."
                )
            return method(self, state, *args, **kwargs)
        restoring = method.__name__ == "restore_or_init"
        if restoring and step is None and getattr(state, "step", None) is None:
            step = 0  # the template's step is not read
        wrapped, unwrap = any_tree.wrapped(state, step, f"Checkpointer.{method.__name__}")
        out = method(self, wrapped, *args, **kwargs)
        if not restoring:
            return out
        return (unwrap(out[0]), *out[1:]) if isinstance(out, tuple) else unwrap(out)

    return wrapper


def in_checkpoint_phase(method):
    """The stall detector gives a save or restore up to its ceiling (``jddp.runtime.progress``)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with progress.phase("checkpoint"):
            return method(*args, **kwargs)

    return wrapper


class Lifecycle:
    """The state a ``Checkpointer``'s parts share, and what its save and restore paths both use."""

    # Set by ``Checkpointer.__init__`` (the options) and its ``_start`` (the directory's part).
    directory: Any  # a pathlib.Path, or Orbax's etils.epath.Path for a remote one (``storage.resolve``)
    read_only: bool
    save_every: int | None
    max_to_keep: int | None
    config: Any
    allow_config_change: bool
    allow_other_run: bool
    exit_on_preemption: bool
    on_existing: str
    preempted: bool
    restored_from: str | None
    damaged: list[tuple[int, str]]
    stats: dict[str, Any]
    _fingerprint: str | None
    _lease: lease.Lease | None
    _closed: bool
    _closing: bool
    _run_id: str | None
    _options: ocp.CheckpointManagerOptions
    _manager: ocp.CheckpointManager
    _pending: concurrent.futures.Future | None
    _writer: concurrent.futures.ThreadPoolExecutor | None
    _snapshots: snapshot.Snapshots | None
    _preemption: preemption.Preemption | None
    _step: int | None  # host-side step, the same on every process
    _last_saved: int | None
    _unconfirmed: list[int]  # steps handed to Orbax and not yet known written
    _trimmer: memory.Trimmer

    def _give_back_lease(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    def _check_open(self, action: str) -> None:
        standby.wait()  # a standby process: only woken may it touch the directory (it starts this Checkpointer)
        if self._closed:
            raise CheckpointError(
                f"Cannot {action}: this Checkpointer of {str(self.directory)!r} is closed. Open a new "
                f"jddp.Checkpointer({str(self.directory)!r}) (a `with` block closes it at its end)."
            )

    def _open(self):
        return orbax_io.open_manager(self.directory, self._options)

    def all_steps(self) -> list[int]:
        """Steps with a published checkpoint, oldest first (read afresh from the directory when read-only)."""
        standby.wait()
        self._join()
        if self.read_only:
            for attempt in range(5):  # the writer's retention may remove a step while Orbax lists it
                try:
                    self._manager.reload()
                    break
                except (FileNotFoundError, NotADirectoryError):  # Orbax names a step removed mid-read either way
                    if attempt == 4:
                        raise
                    time.sleep(0.05)
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    @property
    def fingerprint(self) -> str | None:
        """The config's fingerprint, saved with each checkpoint and snapshot and checked on restore (``jddp.fit``
        sets it from its ``config`` when the Checkpointer has none)."""
        return self._fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str | None) -> None:
        self._fingerprint = value
        # the snapshots' headers carry it too: one set later (by fit) must reach them, or no snapshot matches the
        # restarted process's fingerprint and every restart goes to disk
        snaps = getattr(self, "_snapshots", None)
        if snaps is not None:
            snaps.fingerprint = value

    def _join(self) -> None:
        """Waits until Orbax has taken the save handed to the writer thread; raises its error, if any.

        Orbax's ``save`` first waits for the previous write, so a write that failed
        after its hand-over fails the next hand-over, and its error comes out here.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            with self._write_errors():
                pending.result()

    @contextlib.contextmanager
    def _write_errors(self):
        """Around a call that may raise a failed write's error.

        The step is then not saved; alone, the manager is opened afresh (Orbax keeps raising a failed write until
        its next save; opening cleans the failed step's temporary directory), so that the error is raised once and
        a retry writes the step. Orbax's error becomes a ``CheckpointError`` naming the directory, the step and
        what to do (Orbax's own error is its ``__cause__``).
        """
        try:
            yield
        except BaseException as error:
            failed = [s for s in self._unconfirmed if not (self.directory / str(s)).exists()]
            self._unconfirmed, self._last_saved = [], None
            if jax.process_count() == 1 and not self._closing:  # a closing one opens no manager it would not use
                with contextlib.suppress(BaseException):
                    self._manager.close()
                self._manager = self._open()
            if isinstance(error, Exception) and not isinstance(error, CheckpointError):
                raise CheckpointError(
                    storage.write_failure(self.directory, failed, list(self._manager.all_steps()), error)
                ) from error
            raise

    def wait(self) -> None:
        """Waits until every started save is published; raises the error of a failed one."""
        standby.wait()
        if self._closed:
            return
        self._join()
        with self._write_errors():
            self._manager.wait_until_finished()
            self._manager.check_for_errors()
        self._unconfirmed = []
        UNFINISHED.discard(self)

    def close(self) -> None:
        """Waits for the last save and releases Orbax's resources, the lease and (when the last one closes) SIGTERM.

        Closing again does nothing; a save after closing is an error.
        """
        self._close(remove_snapshots=sys.exc_info()[0] is None)

    def _close(self, *, remove_snapshots: bool) -> None:
        """``close``; ``remove_snapshots``: the in-memory snapshots are not needed any more (the run went on to its
        close; after an error they stay, for the restart)."""
        standby.wait()
        if self._closed:
            return
        if self._preemption is not None:
            self._preemption.close()
        if self._snapshots is not None:
            self._snapshots.close(remove=remove_snapshots)
        self._closing = True
        try:
            self.wait()
        finally:
            self._closed = True
            UNFINISHED.discard(self)
            with contextlib.suppress(Exception):  # a failed write's error is raised once, by the wait above
                self._manager.close()
            if self._writer is not None:
                self._writer.shutdown()
            self._give_back_lease()
            storage.OrbaxErrorLogs.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and issubclass(kind, SystemExit):
            self._keep_sigterm()
        self._close(remove_snapshots=kind is None)

    def _keep_sigterm(self) -> None:
        """The process is exiting (75 after a preemption save, or any ``sys.exit``): closing leaves SIGTERM to
        jddp's handler, so that a late one (a launcher's forward, a scheduler's repeat) cannot turn the exit
        code into a kill by the signal."""
        self._preemption = None


# Checkpointers with a save started and not yet waited for: held here, so that one the script no longer references (a
# Checkpointer local to a function that returned) is not collected with its last save unpublished and its lease
# held; the exit hook (``close_at_exit``) then still finds it. Left when a wait or close sees the saves published.
UNFINISHED: set[Lifecycle] = set()


def close_at_exit(ref: weakref.ref) -> None:
    """The interpreter exits with this Checkpointer still open: its started saves are written (said on stderr),
    then it is closed. Not after a failure of the group (the peers would not meet its final barrier)."""
    ckpt = ref()
    if ckpt is None or ckpt._closed or not watchdog.group_healthy():
        return
    if ckpt._unconfirmed or ckpt._pending is not None:
        print(
            f"jddp: the script ended without closing the Checkpointer of {str(ckpt.directory)!r}; writing its "
            f"last save (step {ckpt._unconfirmed[-1] if ckpt._unconfirmed else '?'}) before the exit. Call "
            "close() (or use a `with` block) to wait for it where you choose.",
            file=sys.stderr,
            flush=True,
        )
    ckpt._keep_sigterm()
    try:
        ckpt._close(remove_snapshots=False)  # an uncaught error may have ended the script: the restart needs them
    except Exception as error:  # at exit nobody can catch it: say it
        print(f"jddp: the Checkpointer of {str(ckpt.directory)!r} failed to close at exit: {error}", file=sys.stderr)
