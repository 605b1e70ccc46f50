"""A ``Checkpointer``'s restore path: ``restore_or_init``, from memory first, else the newest step every process loads.

A part of ``jddp.checkpoint.checkpointer.Checkpointer`` (``jddp.checkpoint.lifecycle`` says how the parts share
one state): the in-memory snapshots agreed between the processes (``snapshot_restore``), else the steps on disk
newest first, each read back by ``restore`` and agreed; a damaged one set aside (a writer) and warned of, a wrong
model or config refused; the loader's position and ``extra`` restored with the state.
"""

from __future__ import annotations

import time
import warnings

import jax

from jddp.checkpoint import checks, lifecycle, preemption, restore, snapshot_restore, storage
from jddp.checkpoint.errors import CheckpointWarning
from jddp.checkpoint.restore import DAMAGED_SUFFIX
from jddp.runtime import dispatch, progress, standby
from jddp.runtime.state import TrainState


class Restoring(lifecycle.Lifecycle):
    """``Checkpointer``'s restore path."""

    @lifecycle.accepts_any_tree
    @progress.collective_call("Checkpointer.restore_or_init")
    @lifecycle.in_checkpoint_phase
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
