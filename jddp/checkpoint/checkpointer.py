"""``Checkpointer``: saves and restores the complete training state on Orbax (the manual is in ``jddp.checkpoint``).

About 450 lines, over the ~400 of the style guide: saving and restoring share one
Orbax manager, its writer thread and the step bookkeeping (the last step saved,
a failed write reopening the manager), and split apart they would pass that
state back and forth; digests, the hand-over of buffers and preemption are in
modules of their own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jddp import exitcodes, validate
from jddp._version import __version__
from jddp.checkpoint import digest, handoff, preemption
from jddp.runtime import dispatch
from jddp.runtime.state import TrainState

STATE, LOADER, META = "state", "loader", "meta"
DAMAGED_SUFFIX = ".damaged"


class CheckpointWarning(UserWarning):
    """A checkpoint could not be used (damaged): an older one is used instead, or, when none is left, none."""


def _as_dict(state: TrainState) -> dict[str, Any]:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


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
      async_save: write in the background (default) or block until written.
      exit_on_preemption: after the preemption save, raise
        ``SystemExit(EXIT_PREEMPTED)``; when False, ``maybe_save`` returns and
        ``preempted`` becomes True.
      timeout_s: limit for Orbax's barriers between processes during a save.
      preemption_check_s: in a group, how often (in process 0's wall time,
        converted to steps) the processes exchange preemption notices: the
        longest a SIGTERM waits before the save starts, plus one step. Each
        exchange is one small all-gather; 0 exchanges at every step.

    Raises:
      PermissionError: if ``directory`` cannot be created or written.
      ValueError: for bad options.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        save_every: int | None = None,
        max_to_keep: int | None = 3,
        config: Any = None,
        allow_config_change: bool = False,
        async_save: bool = True,
        exit_on_preemption: bool = True,
        timeout_s: int = 600,
        preemption_check_s: float = 1.0,
    ) -> None:
        validate.check_int("save_every", save_every, optional=True)
        validate.check_int("max_to_keep", max_to_keep, optional=True)
        if (
            isinstance(preemption_check_s, bool)
            or not isinstance(preemption_check_s, int | float)
            or not (0 <= preemption_check_s < float("inf"))
        ):
            raise ValueError(f"`preemption_check_s` must be a finite number >= 0, got {preemption_check_s!r}.")
        self.directory = Path(directory).absolute()
        self._check_writable()
        self.save_every, self.max_to_keep = save_every, max_to_keep
        self.fingerprint, self.config = digest.config_fingerprint(config)
        self.allow_config_change = allow_config_change
        self.exit_on_preemption = exit_on_preemption
        self.preempted = False
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
            async_options=ocp.AsyncOptions(timeout_secs=timeout_s),
        )
        self._manager = self._open()
        # Alone on CPU, Orbax's blocking part of an async save (an event loop, several threads started, the
        # copy as views) runs in this thread while training goes on; the caller only pins the buffers.
        self._writer = None
        if async_save and jax.process_count() == 1:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jddp-checkpoint")
            self._writer.submit(lambda: None)  # starts its thread now, not during the first save
        self._pending: concurrent.futures.Future | None = None
        self._preemption = preemption.Preemption(float(preemption_check_s))
        self._step: int | None = None  # host-side step, the same on every process
        self._last_saved: int | None = None
        self.stats = {"saves": 0, "blocked_s": 0.0, "restore_s": 0.0}
        self.damaged: list[tuple[int, str]] = []  # (step, reason) of each checkpoint set aside by a restore

    # ---------------------------------------------------------------- basics

    def _check_writable(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".jddp-write-probe-{jax.process_index()}-{os.getpid()}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as error:
            raise PermissionError(
                f"Checkpoint directory {str(self.directory)!r} is not writable by process {jax.process_index()} "
                f"({error.strerror or error}). Choose a directory this user can write (on a file system every "
                "process sees), or fix its permissions."
            ) from None

    def _open(self):
        handlers = {
            STATE: ocp.StandardCheckpointHandler(),
            LOADER: ocp.JsonCheckpointHandler(),
            META: digest.MetaHandler(),
        }
        return ocp.CheckpointManager(self.directory, options=self._options, item_handlers=handlers)

    def all_steps(self) -> list[int]:
        """Steps with a published checkpoint, oldest first."""
        self._join()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ---------------------------------------------------------------- saving

    def save(self, state: TrainState, loader=None, *, wait: bool = False) -> int:
        """Saves ``state`` (and ``loader``'s position) now, at the state's step; returns the step.

        Every process must call it. With ``wait`` (or ``async_save=False``) it
        returns when the checkpoint is published.
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"`state` must be a jddp.TrainState, got {type(state).__name__}.")
        dispatch.DISPATCHER.drain()
        self._join()  # one save at a time, as Orbax keeps it
        with self._write_errors():
            self._manager.check_for_errors()  # a background write that has failed by now
        start = time.perf_counter()
        tree = _as_dict(state)
        step = int(jax.device_get(state.step))
        self._step = step
        # Saved already (a resumed run's final save): skip on every process if any process sees the step, so
        # that processes with different views of a shared file system never split between saving and not.
        if not preemption.all_agree(step != self._last_saved and step not in self._manager.all_steps()):
            if wait:
                self.wait()
            return step
        meta = {
            "step": step,
            "processes": jax.process_count(),
            "devices": jax.device_count(),
            "config_fingerprint": self.fingerprint,
            "config": self.config,
            "versions": {"jddp": __version__, "jax": jax.__version__, "orbax": _orbax_version()},
            "leaves": digest.describe_leaves(tree),
            "digests": concurrent.futures.Future(),  # set below; read by MetaHandler in the background
            "time": time.time(),
        }
        saved = jax.tree.map(handoff.one_copy_per_process, tree)
        items = {STATE: ocp.args.StandardSave(saved), META: digest.MetaSave(meta)}
        if loader is not None:
            items[LOADER] = ocp.args.JsonSave(loader.get_state())
        digests = meta["digests"]
        try:
            if self._writer is not None and handoff.on_cpu(saved):
                digests.set_result(digest.digest_array(tree))
                pins = handoff.pin(saved)
                self._pending = self._writer.submit(self._hand_over, step, ocp.args.Composite(**items), pins)
            else:
                if not self._options.enable_async_checkpointing:
                    digests.set_result(digest.digest_array(tree))
                self._manager.save(step, args=ocp.args.Composite(**items), force=True)
                if not digests.done():
                    digests.set_result(digest.digest_array(tree))  # dispatched before any later step can donate `tree`
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
        """Around a call that may raise a failed write's error: the step is then not saved, and, alone, the
        manager is opened afresh (Orbax keeps raising a failed write until its next save; opening cleans the
        failed step's temporary directory), so that the error is raised once and a retry writes the step."""
        try:
            yield
        except BaseException:
            self._last_saved = None
            if jax.process_count() == 1:
                with contextlib.suppress(BaseException):
                    self._manager.close()
                self._manager = self._open()
            raise

    def maybe_save(self, state: TrainState, loader=None) -> bool:
        """Call once per training step, on every process. Saves every ``save_every`` steps and on preemption.

        Every process must call it the same number of times (once after each
        step): it counts the steps on the host, and in a group the preemption
        exchange is an all-gather at steps so counted. A process that calls it
        more or less often than the others meets their all-gather at another
        point or never, and the group hangs until the peer timeout.

        Returns:
          True if a checkpoint was started at this step.

        Raises:
          SystemExit: with ``EXIT_PREEMPTED`` (75) after the preemption save,
            unless ``exit_on_preemption=False``.
        """
        if self._step is None:
            self._step = int(jax.device_get(state.step))
        else:
            self._step += 1
        step = self._step
        if not self.preempted and self._preemption.reached(step):
            self.save(state, loader, wait=True)
            self.preempted = True
            if self.exit_on_preemption:
                raise SystemExit(exitcodes.EXIT_PREEMPTED)
            return True
        if self.save_every is not None and step % self.save_every == 0:
            self.save(state, loader)
            return True
        return False

    def wait(self) -> None:
        """Waits until every started save is published; raises the error of a failed one."""
        self._join()
        with self._write_errors():
            self._manager.wait_until_finished()
            self._manager.check_for_errors()

    def close(self) -> None:
        """Waits for the last save and releases Orbax's resources (and SIGTERM, when the last one closes)."""
        self._preemption.close()
        try:
            self.wait()
        finally:
            self._manager.close()
            if self._writer is not None:
                self._writer.shutdown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- restoring

    def restore_or_init(self, state: TrainState, loader=None):
        """The newest loadable checkpoint restored into ``state``'s shardings, or ``state`` itself.

        Args:
          state: a fresh state from ``DataParallel.init`` on the current mesh:
            it gives the structure, shapes and shardings to restore into.
          loader: a data loader whose position is restored too.

        Returns:
          ``state`` when no checkpoint exists or none can be loaded (see the
          module docstring), else the restored state; with a ``loader``, the
          pair ``(state, loader)``.

        Raises:
          ValueError: if the checkpoint belongs to another model (names the first
            leaf whose path, shape or dtype differs) or another config (unless
            ``allow_config_change``), or another data setup (the loader says which).
        """
        if not isinstance(state, TrainState):
            raise TypeError(f"`state` must be a jddp.TrainState from DataParallel.init, got {type(state).__name__}.")
        dispatch.DISPATCHER.drain()
        start = time.perf_counter()
        failures = []
        restored = None
        for step in reversed(self.all_steps()):
            meta, reason = self._read_meta(step)
            if meta is not None:
                self._check_compatible(step, meta, state)  # a wrong model or config is an error, not damage
                result, reason = self._try_restore(step, meta, state, loader)
            ok = preemption.all_agree(reason is None)
            if ok:
                restored = result
                break
            reason = reason or "damaged on another process"
            failures.append((step, reason))
            warnings.warn(
                f"Checkpoint step {step} in {self.directory} cannot be used ({reason}); moving it to "
                f"{step}{DAMAGED_SUFFIX} and trying the previous one.",
                CheckpointWarning,
                stacklevel=2,
            )
            self._set_aside(step)
        self.damaged.extend(failures)
        if restored is None and failures:
            listed = "; ".join(f"step {s}: {r}" for s, r in failures)
            warnings.warn(
                f"No checkpoint in {self.directory} can be loaded ({listed}). They are kept as "
                f"<step>{DAMAGED_SUFFIX}; training starts again from the state passed in, at step "
                f"{int(jax.device_get(state.step))}.",
                CheckpointWarning,
                stacklevel=2,
            )
        self.stats["restore_s"] = time.perf_counter() - start
        if restored is None:
            self._step = int(jax.device_get(state.step))
            return (state, loader) if loader is not None else state
        new_state, loader_state, step = restored
        if loader is not None and loader_state is not None:
            loader.set_state(loader_state)
        self._step = self._last_saved = step
        return (new_state, loader) if loader is not None else new_state

    def _read_meta(self, step: int) -> tuple[dict | None, str | None]:
        path = self.directory / str(step) / META / "metadata"
        try:
            return json.loads(path.read_text()), None
        except FileNotFoundError:
            return None, f"its metadata file {path.relative_to(self.directory)} is missing"
        except (OSError, ValueError) as error:
            return None, f"its metadata cannot be read ({type(error).__name__}: {error})"

    def _check_compatible(self, step: int, meta: dict, state: TrainState) -> None:
        mine = digest.describe_leaves(_as_dict(state))
        theirs = meta.get("leaves", [])
        differ = [(a, b) for a, b in zip(theirs, mine, strict=False) if a != b]
        differ.sort(key=lambda pair: not pair[1][0].startswith("['params']"))  # name a parameter first
        if differ:
            a, b = differ[0]
            raise ValueError(
                f"Checkpoint step {step} in {self.directory} holds another model: its leaf {a[0]} has shape "
                f"{tuple(a[1])} and dtype {a[2]}, but the state here has {b[0]} with shape {tuple(b[1])} and dtype "
                f"{b[2]}. Restore into the model that was saved, or use another directory."
            )
        if len(theirs) != len(mine):
            raise ValueError(
                f"Checkpoint step {step} in {self.directory} holds another model: {len(theirs)} state leaves saved, "
                f"{len(mine)} here. Restore into the model that was saved, or use another directory."
            )
        if self.fingerprint and meta.get("config_fingerprint") and meta["config_fingerprint"] != self.fingerprint:
            saved = meta.get("config", {})
            keys = sorted(k for k in set(saved) | set(self.config) if saved.get(k) != self.config.get(k))
            changes = ", ".join(f"{k}: {saved.get(k)!r} -> {self.config.get(k)!r}" for k in keys) or "(details unknown)"
            message = (
                f"Checkpoint step {step} in {self.directory} was saved with another config ({changes}). "
                "Pass allow_config_change=True to resume with the new config anyway, or use another directory."
            )
            if not self.allow_config_change:
                raise ValueError(message)
            warnings.warn(message, CheckpointWarning, stacklevel=3)

    def _try_restore(self, step: int, meta: dict, state: TrainState, loader) -> tuple[Any, str | None]:
        target = _as_dict(state)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target)
        items: dict[str, ocp.args.CheckpointArgs] = {STATE: ocp.args.StandardRestore(abstract)}
        has_loader = (self.directory / str(step) / LOADER).exists()
        if loader is not None and has_loader:
            items[LOADER] = ocp.args.JsonRestore()
        # A restore that fails inside Orbax leaves coroutines never awaited; their RuntimeWarnings (at once or
        # when collected) are noise of Orbax's failure path, so they are collected here, under this filter.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            failure = None
            try:
                result = self._manager.restore(step, args=ocp.args.Composite(**items))
                leaves = jax.tree.leaves(result[STATE])
                tree = jax.tree.unflatten(jax.tree.structure(target), leaves)
            except Exception as error:  # Orbax raises many types for damaged files
                text = str(error).splitlines()[0] if str(error) else ""
                failure = f"restore failed: {type(error).__name__}: {text[:300]}"
            if failure is not None:
                gc.collect()  # the error and its frames are gone: Orbax's leftovers go now, under the filter
                return None, failure
        digests = digest.state_digests(tree)
        bad = [d[0] for d, got, want in zip(meta["leaves"], digests, meta["digests"], strict=True) if got != want]
        if bad:
            return None, f"digest mismatch in {len(bad)} leaf(s), first {bad[0]}"
        if loader is not None and not has_loader:
            return None, "it has no data loader position"
        new_state = TrainState(**tree)
        return (new_state, result[LOADER] if LOADER in items else None, step), None

    def _set_aside(self, step: int) -> None:
        if jax.process_index() == 0:
            source = self.directory / str(step)
            target = self.directory / f"{step}{DAMAGED_SUFFIX}"
            n = 1
            while target.exists():
                n += 1
                target = self.directory / f"{step}{DAMAGED_SUFFIX}{n}"
            if source.exists():
                shutil.move(source, target)
        if jax.process_count() > 1:
            from jddp.runtime import distributed

            distributed.barrier(f"checkpoint-set-aside-{step}", timeout_s=120)
        self._manager = self._open()


def _orbax_version() -> str:
    from importlib.metadata import version

    return version("orbax-checkpoint")
