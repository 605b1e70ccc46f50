"""A ``Checkpointer``'s save path: ``save``, ``maybe_save``, a step the directory already holds, the writer thread.

A part of ``jddp.checkpoint.checkpointer.Checkpointer`` (``jddp.checkpoint.lifecycle`` says how the parts share
one state): a save pins the state's buffers and hands them to Orbax (in the writer thread when alone on CPU), with
the step's metadata and digests; ``maybe_save`` counts the steps on the host, saves every ``save_every`` and on
preemption, and takes the in-memory snapshots.
"""

from __future__ import annotations

import time
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp

from jddp import exitcodes, validate
from jddp.checkpoint import checks, digest, handoff, lease, lifecycle, orbax_io, preemption, restore
from jddp.checkpoint.errors import CheckpointError, CheckpointStepExistsError, CheckpointWarning
from jddp.runtime import dispatch, distributed, progress
from jddp.runtime.state import TrainState


class Saving(lifecycle.Lifecycle):
    """``Checkpointer``'s save path."""

    @lifecycle.accepts_any_tree
    @progress.collective_call("Checkpointer.save")
    @lifecycle.in_checkpoint_phase
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
        lifecycle.UNFINISHED.add(self)
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

    @lifecycle.accepts_any_tree
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
        write = snaps is not None and step % self._preemption.snapshot_every == 0
        if snaps is not None and (write or snaps.keeps):  # keeps: every step's copy, kept (snapshot_kept)
            # An `extra` with get_state_later (jddp.fit's running means) is read by the writer: its get_state would
            # wait for this step's metrics, and the loop would no longer run ahead of the devices.
            later = getattr(extra, "get_state_later", None)
            snaps.take(
                step,
                restore.as_dict(state),
                loader.get_state() if loader is not None else None,
                later() if callable(later) else extra.get_state() if extra is not None else None,
                write=write,
            )
            self.stats["snapshots"], self.stats["snapshot_s"] = snaps.taken, snaps.seconds
        self._trimmer.maybe()
        return saved
