"""``Checkpointer``: saves and restores the complete training state on Orbax (the manual is in ``jddp.checkpoint``).

About 650 lines, over the ~450 of the style guide, because one object holds one
state: saving, the preemption save and restoring share one Orbax manager, its
writer thread and the step bookkeeping (the host-side step, the last step saved,
the steps not yet known written, a failed write or a damaged step reopening the
manager), and split apart they would pass that state back and forth. What does
not share it is in modules of their own: the arguments' checks (``checks``),
Orbax's options, handlers and items (``orbax_io``), the restore from in-memory
snapshots agreed between processes (``snapshot_restore``), digests, the
hand-over of buffers, preemption, the lease, the directory's checks and messages
(``storage``) and reading one step back (``restore``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import sys
import time
import warnings
import weakref
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jddp import envvars, exitcodes, validate
from jddp.checkpoint import (
    any_tree,
    checks,
    digest,
    handoff,
    identity,
    lease,
    orbax_io,
    preemption,
    restore,
    snapshot,
    snapshot_restore,
    storage,
)
from jddp.checkpoint.errors import CheckpointError, CheckpointStepExistsError, CheckpointWarning
from jddp.checkpoint.restore import DAMAGED_SUFFIX
from jddp.runtime import dispatch, distributed, memory, progress, standby, watchdog
from jddp.runtime.state import TrainState


def _any_tree(method):
    """A state of the user's own (any pytree of arrays: a Flax ``TrainState``, an Equinox model and its optimizer
    state) taken where a ``TrainState`` is, with ``step=`` or its own ``step``; ``restore_or_init`` gives back a tree
    of the same kind (``jddp.checkpoint.any_tree``). It is one frame more between the user and every warning of
    these methods: their ``stacklevel``s count it."""

    @functools.wraps(method)
    def wrapper(self, state, *args, step=None, **kwargs):
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


def _in_checkpoint_phase(method):
    """The stall detector gives a save or restore up to its ceiling (``jddp.runtime.progress``)."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with progress.phase("checkpoint"):
            return method(*args, **kwargs)

    return wrapper


class Checkpointer:
    """Saves and restores the complete training state; see the ``jddp.checkpoint`` docstring.

    Args:
      directory: where the step directories go (created; every process must be
        able to write there, e.g. a shared file system for several hosts).
      save_every: ``maybe_save`` saves when the step is a multiple of this;
        ``None`` saves only on demand and on preemption.
      max_to_keep: newest checkpoints kept (``None`` keeps all).
      config: the run's config; its fingerprint is saved and checked on restore.
      allow_config_change: restore a checkpoint whose config fingerprint
        differs (a warning instead of an error).
      allow_other_run: restore a checkpoint that another run wrote (another
        run id than the directory's ``jddp.run``, e.g. a step copied in from
        another run's directory): a warning naming both runs instead of an
        error. In-memory snapshots of another run are never restored.
      async_save: write in the background (default) or block until written.
      exit_on_preemption: after the preemption save, raise
        ``SystemExit(EXIT_PREEMPTED)``; when False, ``maybe_save`` returns and
        ``preempted`` becomes True.
      timeout_s: limit for Orbax's barriers between processes during a save.
      preemption_check_s: in a group, how often (in process 0's wall time,
        converted to steps) the processes exchange preemption notices: the
        longest a SIGTERM waits before the save starts, plus one step. Each
        exchange is one small all-gather; 0 exchanges at every step.
      read_only: for evaluators and notebooks beside a training run: restores
        the newest complete step (reading the directory afresh each time),
        never saves, never cleans up, never sets a damaged step aside, and
        takes no lease. The directory may not exist yet.
      lease_timeout_s: a writer holds ``<directory>/jddp.lease`` while open
        (``jddp.checkpoint.lease``); another writer is refused until the
        lease's heartbeat is this old, or at once when its owner was a
        process of this host that no longer runs.
      snapshots: keep in-memory snapshots of the state outside the process
        (``jddp.checkpoint.snapshot``), which a restart restores first: None
        (default) when ``$JDDP_SNAPSHOT_DIR`` is set (``jddp launch`` sets it)
        and ``$JDDP_SNAPSHOTS`` is not 0, True to require it, False never.
      snapshot_budget: the share of the step time snapshots may take; the
        steps between snapshots adapt to it (measured), 1 when they cost less.
      snapshot_every: a fixed number of steps between snapshots instead
        (``snapshot_budget`` is then not used); None: ``$JDDP_SNAPSHOT_EVERY``
        if set.
      on_existing: what ``save`` does with a step the directory already holds
        and this Checkpointer neither saved nor restored: ``"refuse"`` raises
        ``CheckpointStepExistsError``, ``"overwrite"`` replaces it, ``"keep"``
        keeps it with a ``CheckpointWarning`` (decided on every process alike).

    Raises:
      CheckpointLeaseError: if another run writes to ``directory``.
      NotADirectoryError: if ``directory`` or one of its parents is a file.
      PermissionError: if ``directory`` cannot be created or written.
      ValueError: for bad options.
    """

    @progress.collective_call("Checkpointer()")
    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int | None = None,
        max_to_keep: int | None = 3,
        config: Any = None,
        allow_config_change: bool = False,
        allow_other_run: bool = False,
        async_save: bool = True,
        exit_on_preemption: bool = True,
        timeout_s: int = 600,
        preemption_check_s: float = 1.0,
        read_only: bool = False,
        lease_timeout_s: float = 60.0,
        snapshots: bool | None = None,
        snapshot_budget: float = 0.01,
        snapshot_every: int | None = None,
        on_existing: str = "refuse",
    ) -> None:
        distributed.check_joined()
        directory, snapshot_root = checks.check_options(
            directory,
            save_every=save_every,
            max_to_keep=max_to_keep,
            allow_config_change=allow_config_change,
            allow_other_run=allow_other_run,
            async_save=async_save,
            exit_on_preemption=exit_on_preemption,
            timeout_s=timeout_s,
            preemption_check_s=preemption_check_s,
            read_only=read_only,
            lease_timeout_s=lease_timeout_s,
            snapshots=snapshots,
            snapshot_budget=snapshot_budget,
            snapshot_every=snapshot_every,
            on_existing=on_existing,
        )
        self.on_existing = on_existing
        fingerprint = digest.config_fingerprint(config)  # a config it cannot read: refused before the directory
        self.directory = storage.resolve(directory)
        self.read_only = read_only
        self._lease: lease.Lease | None = None
        self._closed = self._closing = False
        self.save_every, self.max_to_keep = save_every, max_to_keep
        self.fingerprint, self.config = fingerprint
        self.allow_config_change = allow_config_change
        self.allow_other_run = allow_other_run
        self._run_id: str | None = None
        self.exit_on_preemption = exit_on_preemption
        self.preempted = False
        self._pending: concurrent.futures.Future | None = None
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._snapshots: snapshot.Snapshots | None = None
        self._preemption: preemption.Preemption | None = None
        # After a restore_or_init that restored: "memory" (every process its own snapshot), "peer" (a snapshot sent
        # by another process to those whose memory was lost) or "disk".
        self.restored_from: str | None = None
        self._step: int | None = None  # host-side step, the same on every process
        self._last_saved: int | None = None
        self._unconfirmed: list[int] = []  # steps handed to Orbax and not yet known written
        self.stats = {"saves": 0, "blocked_s": 0.0, "restore_s": 0.0, "snapshots": 0, "snapshot_s": 0.0}
        self._trimmer = memory.Trimmer()  # the heap's free pages back to the system, once a minute (maybe_save)
        self.damaged: list[tuple[int, str]] = []  # (step, reason) of each checkpoint set aside by a restore
        start = functools.partial(
            self._start,
            lease_timeout_s=float(lease_timeout_s),
            async_save=async_save,
            timeout_s=timeout_s,
            preemption_check_s=float(preemption_check_s),
            snapshot_root=snapshot_root,
            snapshots=snapshots,
            snapshot_budget=float(snapshot_budget),
            snapshot_every=snapshot_every,
        )
        # What touches the directory (the lease, Orbax's manager and its cleanup) waits in a standby process of the
        # next attempt (jddp launch) until it is woken: the attempt it stands by for still writes there.
        standby.on_wake(start)

    def _start(
        self,
        *,
        lease_timeout_s: float,
        async_save: bool,
        timeout_s: int,
        preemption_check_s: float,
        snapshot_root,
        snapshots: bool | None,
        snapshot_budget: float,
        snapshot_every: int | None,
    ) -> None:
        """The directory's part of ``__init__``: its lease, Orbax's manager, the writer, snapshots, SIGTERM."""
        read_only = self.read_only
        if not read_only:
            storage.check_writable(self.directory, probe=jax.process_index() != 0 or storage.is_remote(self.directory))
            self._lease = lease.take(self.directory, lease_timeout_s)
        self._options = orbax_io.manager_options(
            read_only=read_only,
            max_to_keep=self.max_to_keep,
            async_save=async_save,
            timeout_s=timeout_s,
            barrier_prefix=orbax_io.barrier_prefix(self.directory),
        )
        try:
            self._manager = self._open()
            self._run_id = identity.directory_run(self.directory, self._newest_meta_run, read_only=read_only)
        except BaseException:
            self._give_back_lease()
            raise
        try:
            self._start_workers(async_save, snapshot_root, snapshots, snapshot_budget, snapshot_every,
                                preemption_check_s)  # fmt: skip
        except BaseException:  # refused (a snapshot directory that cannot be made, SIGTERM off the main thread)
            self._undo_start()
            raise
        storage.OrbaxErrorLogs.hold()  # released by close

    def _undo_start(self) -> None:
        """What ``_start`` took, given back, so that the same call with corrected arguments succeeds in this process
        (a notebook): the writer threads, Orbax's manager, the lease."""
        for pool in (self._writer, self._snapshots._writer if self._snapshots is not None else None):
            if pool is not None:
                pool.shutdown(wait=False)
        self._writer = self._snapshots = None
        self._manager.close()
        self._give_back_lease()

    def _start_workers(self, async_save, snapshot_root, snapshots, snapshot_budget, snapshot_every, check_s) -> None:
        read_only = self.read_only
        # Alone on CPU, Orbax's blocking part of an async save (an event loop, several threads started, the
        # copy as views) runs in this thread while training goes on; the caller only pins the buffers.
        if async_save and not read_only and jax.process_count() == 1:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jddp-checkpoint")
            self._writer.submit(lambda: None)  # starts its thread now, not during the first save
        wanted = snapshots if snapshots is not None else envvars.get("JDDP_SNAPSHOTS")
        if snapshot_root is not None and wanted and not read_only:
            self._snapshots = snapshot.Snapshots(
                snapshot_root,
                self.directory,
                fingerprint=self.fingerprint,
                run=self._run_id,
                budget=snapshot_budget,
                every=snapshot_every if snapshot_every is not None else envvars.get("JDDP_SNAPSHOT_EVERY"),
            )
        # A reader never saves, so it leaves SIGTERM alone.
        self._preemption = None if read_only else preemption.Preemption(check_s)
        # A script that ends without close() (torch.save habits): its last async save would die with the
        # interpreter, and the lease stay behind. At exit, it is finished and the Checkpointer closed: among
        # threading's exit hooks, which run before concurrent.futures refuses new work at shutdown (Orbax's
        # writes need it; an atexit hook runs too late), and before non-daemon threads are joined.
        if not read_only:
            watchdog.at_shutdown(functools.partial(_close_at_exit, weakref.ref(self)))

    # ---------------------------------------------------------------- basics

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

    @property
    def run_id(self) -> str | None:
        """The id of the run that writes this directory (``jddp.checkpoint.identity``): made by its first writer,
        the same after every restart; saved with each checkpoint and snapshot and checked on restore. None for a
        reader of a directory that holds no run."""
        standby.wait()
        return self._run_id

    def _newest_meta_run(self) -> str | None:
        """The run id in the newest checkpoint's metadata that names one (a directory without ``jddp.run``)."""
        for step in sorted(self._manager.all_steps(), reverse=True):
            meta, _ = restore.read_meta(self.directory, step)
            if isinstance(meta, dict) and isinstance(meta.get("run"), str) and meta["run"]:
                return meta["run"]
        return None

    @property
    def snapshot_every(self) -> int | None:
        """The steps between in-memory snapshots now, as the processes agreed them (None: no snapshots)."""
        standby.wait()
        if self._snapshots is None or self._preemption is None:
            return None
        return self._preemption.snapshot_every

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---------------------------------------------------------------- saving

    @_any_tree
    @progress.collective_call("Checkpointer.save")
    @_in_checkpoint_phase
    def save(self, state: TrainState, loader=None, *, wait: bool = False, extra=None) -> int:
        """Saves ``state`` (and ``loader``'s position) now, at the state's step; returns the step.

        Every process must call it. With ``wait`` (or ``async_save=False``) it
        returns when the checkpoint is published. ``extra``: anything with
        ``get_state()`` (JSON-able, the same on every process) and
        ``set_state(state)``, saved in the same step and restored by
        ``restore_or_init(..., extra=...)`` (``jddp.fit`` keeps its running
        metric means there, so that a resumed run logs what an uninterrupted
        one does).
        """
        self._check_open("save")
        if self.read_only:
            raise CheckpointError(
                f"This Checkpointer of {str(self.directory)!r} is read-only (read_only=True): it never saves. Open "
                "one without read_only in the training run."
            )
        checks.check_state(state, "")
        validate.check_bool("wait", wait)
        checks.check_loader(loader, "get_state")
        checks.check_stateful("extra", extra, "get_state")
        lease.check_held(self._lease, self.directory)
        dispatch.DISPATCHER.drain()
        self._join()  # one save at a time, as Orbax keeps it
        with self._write_errors():
            self._manager.check_for_errors()  # a background write that has failed by now
        start = time.perf_counter()
        tree = restore.as_dict(state)
        layouts = digest.leaf_layouts(state)
        step = int(jax.device_get(state.step))
        if not self._may_write(step):
            self._step = step
            if wait:
                self.wait()
            return step
        self._step = step
        meta = orbax_io.step_meta(
            step, tree, layouts, fingerprint=self.fingerprint, config=self.config, run=self._run_id
        )
        saved = jax.tree.map(handoff.one_copy_per_process, tree)
        items = orbax_io.step_items(saved, meta, loader, extra)
        digests = meta["digests"]
        # The steps since the last wait() not yet seen published; one seen is confirmed (retention may delete it
        # later, which is no failed write). Without this a long run's error listed every step it had saved.
        published = set(self._manager.all_steps())
        self._unconfirmed = [s for s in self._unconfirmed if s not in published] + [step]
        _UNFINISHED.add(self)
        try:
            if self._writer is not None and handoff.on_cpu(saved):
                digests.set_result(digest.digest_array(tree, layouts))
                pins = handoff.pin(saved)
                self._pending = self._writer.submit(self._hand_over, step, ocp.args.Composite(**items), pins)
            else:
                if not self._options.enable_async_checkpointing:
                    digests.set_result(digest.digest_array(tree, layouts))
                with self._write_errors():
                    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
                if not digests.done():
                    # dispatched before any later step can donate `tree`
                    digests.set_result(digest.digest_array(tree, layouts))
        except BaseException as error:
            if not digests.done():  # never leave Orbax's background write waiting
                digests.set_exception(error)
            raise
        self._last_saved = step
        self.stats["saves"] += 1
        self.stats["blocked_s"] += time.perf_counter() - start
        if wait:
            self.wait()
        return step

    def _may_write(self, step: int) -> bool:
        """Whether ``save`` writes ``step``: not when this Checkpointer saved or restored it last (the same state);
        for a step the directory holds otherwise, ``on_existing`` decides (refused, replaced or kept, said). The
        step exists when any process sees it, so that processes with different views of a shared file system
        never split between saving and not."""
        if step == self._last_saved:  # host-side, kept alike on every process
            return False
        if preemption.all_agree(step not in self._manager.all_steps()):
            return True
        others = sorted(s for s in self._manager.all_steps() if s != step)
        if self.on_existing == "refuse":
            raise CheckpointStepExistsError(
                f"Checkpoint directory {str(self.directory)!r} already holds step {step} (not saved by this "
                f"Checkpointer: an earlier run at this path, or a run that went back to an older step); nothing was "
                f"written. Other steps there: {others or 'none'}. Pass on_existing='overwrite' to replace it, "
                "on_existing='keep' to keep it, or use another directory."
            )
        if self.on_existing == "keep":
            warnings.warn(
                f"Checkpoint directory {str(self.directory)!r} already holds step {step}: it is kept and this "
                "state is not saved (on_existing='keep').",
                CheckpointWarning,
                stacklevel=6,
            )
            return False
        # "overwrite": Orbax writes no step that exists, so the old one goes first (process 0 removes it, all wait,
        # all read the directory afresh: a process that did not see it meets the same barrier)
        with self._write_errors():
            self._manager.wait_until_finished()
        if jax.process_index() == 0:
            restore.remove_step(self.directory, step)
        if jax.process_count() > 1:
            distributed.barrier(f"checkpoint-overwrite-{step}", timeout_s=120)
        self._manager.reload()
        return True

    def _hand_over(self, step: int, args, pins: list[np.ndarray]) -> None:
        """In the writer thread: Orbax's blocking part of an async save.

        ``pins`` (views of the buffers) keep a later step from donating them until Orbax holds its own views.
        """
        self._manager.save(step, args=args, force=True)

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

    @_any_tree
    @progress.collective_call("Checkpointer.maybe_save", eager=False)  # every step: the watchdog publishes it
    def maybe_save(self, state: TrainState, loader=None, *, extra=None) -> bool:
        """Call once per training step, on every process. Saves every ``save_every`` steps and on preemption.

        Every process must call it the same number of times (once after each
        step): it counts the steps on the host, and in a group the preemption
        exchange is an all-gather at steps so counted. A process that calls it
        more or less often than the others meets their all-gather at another
        point or never, and the group hangs until the peer timeout.

        Once a minute it also hands the heap's free pages back to the system
        (``jddp.runtime.memory``: a long run that saves often otherwise grows
        under ``jddp launch``'s allocator settings).

        Returns:
          True if a checkpoint was started at this step.

        Raises:
          SystemExit: with ``EXIT_PREEMPTED`` (75) after the preemption save,
            unless ``exit_on_preemption=False``.
        """
        self._check_open("save")
        checks.check_state(state, "")
        if self._step is None:
            self._step = int(jax.device_get(state.step))
        else:
            self._step += 1
        step = self._step
        if self.read_only:
            self.save(state, loader, extra=extra)  # raises: read-only
        assert self._preemption is not None
        snaps = self._snapshots
        if snaps is not None:
            snaps.note_step(step)
        if not self.preempted and self._preemption.reached(step, snaps.proposal() if snaps is not None else 1):
            self.save(state, loader, wait=True, extra=extra)
            self.preempted = True
            if self.exit_on_preemption:
                raise SystemExit(exitcodes.EXIT_PREEMPTED)
            return True
        saved = self.save_every is not None and step % self.save_every == 0
        if saved:
            self.save(state, loader, extra=extra)
            if snaps is not None:
                snaps.disturbed(step)  # the save's time is not the snapshots' cost
        if snaps is not None and step % self._preemption.snapshot_every == 0:
            # An `extra` with get_state_later (jddp.fit's running means) is read by the writer: its get_state would
            # wait for this step's metrics, and the loop would no longer run ahead of the devices.
            later = getattr(extra, "get_state_later", None)
            snaps.take(
                step,
                restore.as_dict(state),
                loader.get_state() if loader is not None else None,
                later() if callable(later) else extra.get_state() if extra is not None else None,
            )
            self.stats["snapshots"], self.stats["snapshot_s"] = snaps.taken, snaps.seconds
        self._trimmer.maybe()
        return saved

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
        _UNFINISHED.discard(self)

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
            _UNFINISHED.discard(self)
            with contextlib.suppress(Exception):  # a failed write's error is raised once, by the wait above
                self._manager.close()
            if self._writer is not None:
                self._writer.shutdown()
            self._give_back_lease()
            storage.OrbaxErrorLogs.release()

    def __enter__(self) -> Checkpointer:
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

    # ---------------------------------------------------------------- restoring

    @_any_tree
    @progress.collective_call("Checkpointer.restore_or_init")
    @_in_checkpoint_phase
    def restore_or_init(self, state: TrainState, loader=None, *, extra=None):
        """The newest loadable checkpoint restored into ``state``'s shardings, or ``state`` itself.

        Args:
          state: a fresh state from ``DataParallel.init`` on the current mesh:
            it gives the structure, shapes and shardings to restore into.
          loader: a data loader whose position is restored too.
          extra: what was passed as ``extra`` to ``save``: its ``set_state`` gets the saved state (not called
            when the step holds none, or when nothing is restored).

        Returns:
          ``state`` when no checkpoint exists or none can be loaded (see the
          module docstring), else the restored state; with a ``loader``, the
          pair ``(state, loader)``.

        Raises:
          ValueError: if the checkpoint belongs to another model (names the first
            leaf whose path, shape or dtype differs) or another config (unless
            ``allow_config_change``), or another data setup (the loader says which).
        """
        self._check_open("restore")
        checks.check_state(state, " from DataParallel.init")
        checks.check_loader(loader, "set_state")
        checks.check_stateful("extra", extra, "set_state")
        standby.wait()  # a standby process of the next attempt (jddp launch) waits here for the failure
        dispatch.DISPATCHER.drain()
        start = time.perf_counter()
        failures = []
        self.restored_from = None
        found = snapshot_restore.from_memory(
            self._snapshots, state, self.fingerprint, self.latest_step, self._run_id, loader
        )
        restored, self.restored_from = found if found is not None else (None, None)
        if self._snapshots is not None:  # every process is past the restore's collectives: nobody reads them now
            self._snapshots.forget_others()
        if restored is None:
            restored, failures = self._restore_from_disk(state, loader, extra)
        self.damaged.extend(failures)
        if restored is None and not failures and self.read_only:
            warnings.warn(storage.nothing_to_read(self.directory), CheckpointWarning, stacklevel=4)
        if restored is None and failures:
            listed = "; ".join(f"step {s}: {r}" for s, r in failures)
            kept = (
                "They are left in place (read-only)" if self.read_only else f"They are kept as <step>{DAMAGED_SUFFIX}"
            )
            warnings.warn(
                f"No checkpoint in {self.directory} can be loaded ({listed}). {kept}; training starts again from "
                f"the state passed in, at step {int(jax.device_get(state.step))}.",
                CheckpointWarning,
                stacklevel=4,
            )
        self.stats["restore_s"] = time.perf_counter() - start
        if restored is None:
            self._step = int(jax.device_get(state.step))
            return (state, loader) if loader is not None else state
        new_state, loader_state, extra_state, step = restored
        if extra is not None and extra_state is not None:
            extra.set_state(extra_state)
        if loader is not None and loader_state is not None:
            self._set_loader(loader, loader_state, step)
        elif loader is not None:
            warnings.warn(
                f"Checkpoint step {step} in {self.directory} has no data loader position (it was saved without a "
                "loader): the model, optimizer state and RNG are restored, and the loader starts from its "
                "beginning. Pass the loader to save/maybe_save to save its position.",
                CheckpointWarning,
                stacklevel=4,
            )
        self._step = self._last_saved = step
        progress.set_step(step)
        return (new_state, loader) if loader is not None else new_state

    def _set_loader(self, loader, loader_state, step: int) -> None:
        """``loader.set_state`` of a restored position; one it refuses is refused naming where it was read."""
        try:
            loader.set_state(loader_state)
        except Exception as error:
            where = (
                f"the in-memory snapshot of step {step} ({self._snapshots.folder})"
                if self.restored_from in ("memory", "peer") and self._snapshots is not None
                else f"the file {step}/{restore.LOADER}/metadata in {self.directory}"
            )
            raise ValueError(
                f"The data loader position saved in {where} cannot be restored into this loader "
                f"({type(error).__name__}: {error}). If the data setup changed, use another directory; if the "
                "file is damaged, move that step aside and restore the one before."
            ) from error

    def _restore_from_disk(self, state: TrainState, loader, extra):
        """``restore_or_init``'s disk part: the newest checkpoint that loads on every process (agreed), each one
        that does not set aside (a writer) and warned of; returns ``(restored or None, [(step, reason)] of those)``.
        """
        restored, failures, tried = None, [], set()
        while restored is None:
            # Read-only, the list is read afresh after a failure: the writer's retention may have removed the step.
            candidates = [s for s in reversed(self.all_steps()) if s not in tried]
            if not candidates:
                break
            step = candidates[0]
            tried.add(step)
            meta, reason = restore.read_meta(self.directory, step)
            if meta is not None:
                restore.check_compatible(self, step, meta, state)  # a wrong model or config is an error, not damage
                result, reason = restore.try_restore(
                    self._manager, self.directory, step, meta, state, loader, extra, read_only=self.read_only
                )
            if preemption.all_agree(reason is None):
                restored = result
                self.restored_from = "disk"
                break
            if reason is not None and restore.ORBAX_STRUCTURE_MISMATCH in reason:  # saved before "empty_nodes"
                raise ValueError(
                    f"Checkpoint step {step} in {self.directory} does not fit the state here: Orbax finds the saved "
                    "tree's structure different (the optimizer or the model changed, e.g. adam -> adamw, with the "
                    f"same arrays). {reason}. Restore with the optimizer and model it was saved with."
                )
            if self.read_only and not (self.directory / str(step)).exists():
                continue  # removed by the writer's max_to_keep meanwhile: not damage
            reason = reason or "damaged on another process"
            failures.append((step, reason))
            what = "leaving it in place (read-only)" if self.read_only else f"moving it to {step}{DAMAGED_SUFFIX}"
            warnings.warn(
                f"Checkpoint step {step} in {self.directory} cannot be used ({reason}); {what} and trying the "
                "previous one.",
                CheckpointWarning,
                stacklevel=5,
            )
            if not self.read_only:
                restore.set_aside(self.directory, step)
                self._manager = self._open()
        return restored, failures


# Checkpointers with a save started and not yet waited for: held here, so that one the script no longer references (a
# Checkpointer local to a function that returned) is not collected with its last save unpublished and its lease
# held; the exit hook (``_close_at_exit``) then still finds it. Left when a wait or close sees the saves published.
_UNFINISHED: set[Checkpointer] = set()


def _close_at_exit(ref: weakref.ref) -> None:
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
