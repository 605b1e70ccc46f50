"""``Checkpointer``: saves and restores the complete training state on Orbax (the manual is in ``jddp.checkpoint``).

This module builds it: its options checked, its directory's part started (the lease, Orbax's manager, the writer
thread, snapshots, SIGTERM), the run it writes for. The parts that share its state are modules of their own: its
life and the state they share (``lifecycle``: the write in flight and its errors, ``wait``, ``close``, the exit
hook), the save path (``saving``) and the restore path (``restoring``). What does not share it is elsewhere too:
the arguments' checks (``checks``), Orbax's options, handlers and items (``orbax_io``), the restore from in-memory
snapshots agreed between processes (``snapshot_restore``), digests, the hand-over of buffers, preemption, the
lease, the directory's checks and messages (``storage``) and reading one step back (``restore``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import weakref
from typing import Any

import jax

from jddp import envvars
from jddp.checkpoint import (
    checks,
    digest,
    identity,
    lease,
    lifecycle,
    orbax_io,
    preemption,
    restore,
    restoring,
    saving,
    snapshot,
    storage,
)
from jddp.checkpoint.restore import (
    DAMAGED_SUFFIX as DAMAGED_SUFFIX,
)  # re-exported: `jddp.checkpoint` takes it from here
from jddp.runtime import distributed, memory, progress, standby, watchdog


class Checkpointer(saving.Saving, restoring.Restoring):
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
            watchdog.at_shutdown(functools.partial(lifecycle.close_at_exit, weakref.ref(self)))

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
