"""Checkpoints of the complete training state on Orbax: async, atomic, verified, resumable anywhere.

    ckpt = jddp.Checkpointer("runs/exp1/ckpt", save_every=500, max_to_keep=3, config=config)
    state, loader = ckpt.restore_or_init(state, loader)   # resumes, or keeps `state` when there is nothing
    for batch in loader:
        state, metrics = dp.step(state, batch)
        ckpt.maybe_save(state, loader)                      # every 500 steps; on SIGTERM: save and exit 75
    ckpt.save(state, loader); ckpt.close()

What a checkpoint (one directory per step, written by Orbax's
``CheckpointManager``) holds:

* ``state``: the ``TrainState`` (step, parameters, optimizer state, model
  state, RNG), every leaf as an array;
* ``loader``: the data loader's position (``DataLoader.get_state()``), global,
  so it resumes on any number of processes;
* ``meta``: the step, the process and device counts, the jddp, JAX and Orbax
  versions, a fingerprint of the config, the path, shape and dtype of every
  state leaf, and a 64-bit digest of every leaf's bytes.

Guarantees:

* **Async.** ``save`` returns before the files are written; ``close`` waits.
  Orbax is handed one copy of each replicated array per process (the buffer of
  that process's first device, not a copy), so it slices nothing while the
  caller waits and every process still writes its share. A single process on
  CPU hands Orbax's own blocking part to a writer thread and returns after
  pinning the buffers with host views (no copy; a pinned buffer is never
  donated, so the next step writes into new memory; a typed PRNG key is
  pinned through its key data) and dispatching the
  digests: medians of 3 to 8 ms at 64 MB on a loaded 2-core machine, at most
  4% of a synchronous save (``benchmarks/checkpoint_stall.py``). Orbax's part
  then runs beside the training loop and competes with it for the GIL. Saves
  do not overlap: a save first waits until Orbax has taken the previous one.
* **Atomic.** Orbax writes into ``<step>.orbax-checkpoint-tmp-*`` and renames
  when complete; a kill at any instant leaves the previous checkpoint intact.
  Leftover temporary directories are removed when a ``Checkpointer`` opens the
  directory.
* **Verified.** Orbax does not checksum: flipped bytes restore as garbage. jddp
  recomputes each leaf's digest after a restore. A damaged checkpoint (missing
  or truncated files, a digest mismatch) produces a warning naming the step and
  the reason, is renamed to ``<step>.damaged``, and the next older one is tried.
  Every process takes the same decision (the outcome of each attempt is
  all-gathered).
* **Every checkpoint damaged.** Then ``restore_or_init`` starts from the state
  passed in, with one more ``CheckpointWarning`` listing every step and reason,
  and ``Checkpointer.damaged`` lists them. It does not raise: a relaunch would
  find the damaged steps set aside and start afresh anyway, so an error would
  only add a crash (and under ``jddp launch --max-restarts``, a restart) before
  the same outcome, and an error that kept the steps in place would crash every
  relaunch. Nothing is deleted: the ``<step>.damaged`` directories stay (Orbax
  ignores them, retention never removes them) for inspection or repair. To stop
  instead, turn the warning into an error
  (``warnings.simplefilter("error", jddp.CheckpointWarning)``): it is raised
  before the step is set aside, so every relaunch stops at it.
* **Any topology.** The state is restored into the shardings of the ``state``
  passed to ``restore_or_init`` (Orbax reshards), and the loader continues the
  same global batch sequence on any process count.
* **Preemption.** While a ``Checkpointer`` is open it catches SIGTERM (to any
  process, e.g. forwarded by ``jddp launch`` or sent by a scheduler to one
  process). A single process stops at the next ``maybe_save``. In a group the
  processes exchange their notices with one small all-gather about every
  ``preemption_check_s`` seconds, at steps they agreed at the previous
  exchange, and all stop at the same step. ``maybe_save`` saves that step,
  waits for the write, and raises ``SystemExit(75)`` (``jddp.EXIT_PREEMPTED``).
  Running again resumes. When the last open ``Checkpointer`` closes, SIGTERM
  gets its default action back and a notice caught meanwhile is dropped.
* **Agreement.** ``maybe_save`` decides from a step counter every process
  keeps the same way (call it once per step on every process) and from
  collectives, never from local state alone. Every process takes part in every
  save (Orbax writes each process's share of every array and synchronises the
  processes: with collectives in the calling thread, which a dead peer turns
  into exit 69 through jddp's watchdog, and with key-value barriers limited by
  ``timeout_s`` in the background).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jddp import exitcodes
from jddp._version import __version__
from jddp.engine import dispatch
from jddp.engine.state import TrainState

STATE, LOADER, META = "state", "loader", "meta"
DAMAGED_SUFFIX = ".damaged"


class CheckpointWarning(UserWarning):
    """A checkpoint could not be used (damaged): an older one is used instead, or, when none is left, none."""


# --------------------------------------------------------------------- digests


def _leaf_digest(x: jax.Array) -> jax.Array:
    """Two weighted sums of the leaf's 32-bit words, mod 2^32.

    The words form rows of 1024; one sum weights each word by an odd constant of
    its column, the other weights each row's sum by an odd constant of its row.
    Odd weights make any change of a single word change the first sum. A typed
    PRNG key is digested through its key data.
    """
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype.itemsize == 2:
        words = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif x.dtype.itemsize == 1:
        words = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    else:  # 4 bytes, or two words per 8-byte element
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    words = words.reshape(-1)
    pad = -words.size % 1024
    rows = jnp.pad(words, (0, pad)).reshape(-1, 1024)
    columns = (jnp.arange(1024, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
    row_weights = (jnp.arange(rows.shape[0], dtype=jnp.uint32) * jnp.uint32(0x85EBCA77)) | jnp.uint32(1)
    row_sums = jnp.sum(rows * columns[None, :], axis=1, dtype=jnp.uint32)
    size = jnp.uint32(words.size)
    return jnp.stack([jnp.sum(row_sums, dtype=jnp.uint32) ^ size, jnp.sum(row_sums * row_weights, dtype=jnp.uint32)])


@jax.jit
def _digests(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([_leaf_digest(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def digest_array(tree) -> jax.Array:
    """Per-leaf digests of ``tree`` as a uint32 [leaves, 2] array, dispatched asynchronously.

    A replicated leaf is digested once, on the device of its first local copy.
    """
    leaves = [x.addressable_shards[0].data if x.is_fully_replicated else x for x in jax.tree.leaves(tree)]
    return _digests(leaves)


def as_hex(digests) -> list[str]:
    return [f"{int(a):08x}{int(b):08x}" for a, b in np.asarray(digests)]


def state_digests(tree) -> list[str]:
    """One 64-bit hex digest per leaf of ``tree``."""
    return as_hex(jax.device_get(digest_array(tree)))


def _describe_leaves(tree) -> list[list]:
    return [
        [jax.tree_util.keystr(path), list(np.shape(x)), str(x.dtype)] for path, x in jax.tree.leaves_with_path(tree)
    ]


def _as_dict(state: TrainState) -> dict[str, Any]:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


def _one_copy_per_process(x: Any) -> Any:
    """A replicated array as the same values on one device per process, sharing that device's buffer.

    Orbax splits the writing of a replicated array among its replicas
    (``use_replica_parallel``), slicing every local replica with a JAX op while
    the caller waits. Handed one replica per process, it slices nothing in a
    single process (the shard is copied to the host as a view) and one slice
    per process in a group, so every process still writes its share. The
    devices are chosen from the sharding alone (the lowest id of each
    process), hence the same on every process. The saved values, and so the
    restore into any sharding, are unchanged.
    """
    if (
        not isinstance(x, jax.Array)
        or not x.is_fully_replicated
        or len(x.sharding.device_set) == 1
        or jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)
    ):
        return x
    first: dict[int, jax.Device] = {}
    for device in sorted(x.sharding.device_set, key=lambda d: d.id):
        first.setdefault(device.process_index, device)
    mine = first[jax.process_index()]
    shard = next(s.data for s in x.addressable_shards if s.device == mine)
    return jax.make_array_from_single_device_arrays(x.shape, _replicated_on(tuple(first.values())), [shard])


def _on_cpu(tree) -> bool:
    return all(d.platform == "cpu" for x in jax.tree.leaves(tree) for d in x.sharding.device_set)


def _host_view(x: jax.Array) -> np.ndarray:
    """A host view of a single-device array's buffer (on CPU: no copy); a typed PRNG key through its key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)  # shares the key array's buffer
    return np.asarray(x)


def _pin(tree) -> list[np.ndarray]:
    """Host views of every local buffer of ``tree``; while they live, no step can donate them (JAX skips the donation).

    A typed PRNG key is pinned through its key data, which shares its buffer:
    ``wrap_key_data(key_data(x))`` would share it too, and a later step would
    donate it from under the writer thread.
    """
    return [_host_view(s.data) for x in jax.tree.leaves(tree) for s in x.addressable_shards]


@functools.lru_cache(maxsize=16)
def _replicated_on(devices: tuple[jax.Device, ...]) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def config_fingerprint(config: Any) -> tuple[str, dict[str, Any]]:
    """A stable fingerprint of a config (dataclass, OmegaConf config, mapping) and its JSON form."""
    if config is None:
        return "", {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        plain = dataclasses.asdict(config)
    elif type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        plain = OmegaConf.to_container(config, resolve=True)
    elif isinstance(config, Mapping):
        plain = dict(config)
    else:
        raise TypeError(f"`config` must be a dataclass, an OmegaConf config or a mapping, got {type(config).__name__}.")
    plain = json.loads(json.dumps(plain, sort_keys=True, default=str))
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16], plain


class MetaHandler(ocp.JsonCheckpointHandler):
    """Orbax's JSON handler, except that ``"digests"`` may be a future of a ``jax.Array``, read in the background.

    ``Checkpointer.save`` dispatches the digest computation only after Orbax's
    blocking part (the copy of the arrays off the devices), so it neither waits
    for it nor delays that copy, and the digests still land inside the
    checkpoint before it is published.
    """

    async def _save_fn(self, x, directory):
        x = dict(x)
        digests = x.get("digests")
        if isinstance(digests, concurrent.futures.Future):
            digests = await asyncio.wrap_future(digests)
        if isinstance(digests, jax.Array):
            x["digests"] = as_hex(await asyncio.to_thread(jax.device_get, digests))
        await super()._save_fn(x, directory)


@ocp.args.register_with_handler(MetaHandler, for_save=True)
@dataclasses.dataclass
class MetaSave(ocp.args.CheckpointArgs):
    item: Mapping[str, Any]


@ocp.args.register_with_handler(MetaHandler, for_restore=True)
@dataclasses.dataclass
class MetaRestore(ocp.args.CheckpointArgs):
    item: Any = None


# --------------------------------------------------------------------- agreement


def _all_agree(flag: bool) -> bool:
    """True only if ``flag`` is True on every process (a collective in a group)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(np.asarray([flag], np.int32)))
    return bool(flags.min())


_SIGTERM = threading.Event()  # set by the handler below; process-wide, shared by every Checkpointer
_handler_users = 0


def _on_sigterm(signum, frame) -> None:
    _SIGTERM.set()


def _install_sigterm_handler() -> bool:
    """Routes SIGTERM to ``_SIGTERM`` while a Checkpointer is open; False where that is impossible.

    Installed over the default action and over a handler not set from Python
    (``signal.getsignal`` gives ``None``: JAX's preemption notifier, which would
    otherwise swallow the signal); a handler the program set itself is left alone.
    """
    global _handler_users
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        if current not in (signal.SIG_DFL, None):
            return False
        signal.signal(signal.SIGTERM, _on_sigterm)
    _handler_users += 1
    return True


def _uninstall_sigterm_handler() -> None:
    """When the last Checkpointer closes: the default action again (JAX's notifier cannot be put back).

    The notice is dropped with the handler: it was for the Checkpointers that
    were open, and a later one must not stop at its first step for it.
    """
    global _handler_users
    _handler_users -= 1
    if _handler_users == 0:
        _SIGTERM.clear()
        if signal.getsignal(signal.SIGTERM) is _on_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class _Preemption:
    """A SIGTERM seen by any process, agreed at one step by all.

    Alone, a process stops at the first step after its signal. In a group, the
    processes exchange their notices with one all-gather at agreed steps (every
    ``check_s`` seconds of process 0's wall time, converted to steps and shared
    by the same all-gather), and all stop at the first of those steps after any
    notice. A notice is a SIGTERM caught here, or JAX's preemption sync point
    (for a signal that JAX caught before a Checkpointer was open). JAX's sync
    point alone is not enough: it is computed in the background from the steps
    the processes had reached, and a process that asks for that step before
    the answer arrives is told False and trains on while the others stop
    (measured under ``jddp launch``: the others exit, it waits forever in the
    next step's collective).
    """

    MAX_INTERVAL = 10_000

    def __init__(self, check_s: float) -> None:
        self.group = jax.process_count() > 1
        self.installed = _install_sigterm_handler()
        self.check_s = check_s
        self.notice = False
        self.next_check: int | None = None
        self.last: tuple[int, float] | None = None  # (step, time) of the last exchange

    def close(self) -> None:
        if self.installed:
            self.installed = False
            _uninstall_sigterm_handler()

    def reached(self, step: int) -> bool:
        """Called once per step with the same steps on every process; True on all of them at one step."""
        self.notice = self.notice or _SIGTERM.is_set() or (self.group and _jax_sync_point(step))
        if not self.group:
            return self.notice
        if self.next_check is not None and step < self.next_check:
            return False
        now = time.monotonic()
        interval = 1
        if self.last is not None and now > self.last[1]:
            per_step = (now - self.last[1]) / max(step - self.last[0], 1)
            interval = int(min(max(self.check_s / per_step, 1), self.MAX_INTERVAL))
        dispatch.DISPATCHER.drain()  # no other program with collectives in flight (JAX_NOTES: deadlock)
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(np.asarray([int(self.notice), interval], np.int32)))
        rows = rows.reshape(jax.process_count(), 2)
        self.next_check = step + int(rows[0, 1])  # process 0's proposal, the same everywhere
        self.last = (step, time.monotonic())
        return bool(rows[:, 0].max())


def _jax_sync_point(step: int) -> bool:
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # the preemption service is off (jax_enable_preemption_service=False)
        return False


# --------------------------------------------------------------------- the checkpointer


class Checkpointer:
    """Saves and restores the complete training state; see the module docstring.

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
        if save_every is not None and (
            isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1
        ):
            raise ValueError(f"`save_every` must be a positive int or None, got {save_every!r}.")
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"`max_to_keep` must be a positive int or None, got {max_to_keep!r}.")
        if (
            isinstance(preemption_check_s, bool)
            or not isinstance(preemption_check_s, int | float)
            or not (0 <= preemption_check_s < float("inf"))
        ):
            raise ValueError(f"`preemption_check_s` must be a finite number >= 0, got {preemption_check_s!r}.")
        self.directory = Path(directory).absolute()
        self._check_writable()
        self.save_every, self.max_to_keep = save_every, max_to_keep
        self.fingerprint, self.config = config_fingerprint(config)
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
        self._preemption = _Preemption(float(preemption_check_s))
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
            META: MetaHandler(),
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
        start = time.perf_counter()
        tree = _as_dict(state)
        step = int(jax.device_get(state.step))
        self._step = step
        if step == self._last_saved or step in self._manager.all_steps():
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
            "leaves": _describe_leaves(tree),
            "digests": concurrent.futures.Future(),  # set below; read by MetaHandler in the background
            "time": time.time(),
        }
        saved = jax.tree.map(_one_copy_per_process, tree)
        items = {STATE: ocp.args.StandardSave(saved), META: MetaSave(meta)}
        if loader is not None:
            items[LOADER] = ocp.args.JsonSave(loader.get_state())
        digests = meta["digests"]
        try:
            if self._writer is not None and _on_cpu(saved):
                digests.set_result(digest_array(tree))
                pins = _pin(saved)
                self._pending = self._writer.submit(self._hand_over, step, ocp.args.Composite(**items), pins)
            else:
                if not self._options.enable_async_checkpointing:
                    digests.set_result(digest_array(tree))
                self._manager.save(step, args=ocp.args.Composite(**items), force=True)
                if not digests.done():
                    digests.set_result(digest_array(tree))  # dispatched before any later step can donate `tree`
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
        """Waits until Orbax has taken the save handed to the writer thread; raises its error, if any."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

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
        """Waits until every started save is published."""
        self._join()
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the last save and releases Orbax's resources (and SIGTERM, when the last one closes)."""
        self._preemption.close()
        try:
            self._join()
            self._manager.wait_until_finished()
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
            ok = _all_agree(reason is None)
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
        mine = _describe_leaves(_as_dict(state))
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
        items = {STATE: ocp.args.StandardRestore(abstract)}
        has_loader = (self.directory / str(step) / LOADER).exists()
        if loader is not None and has_loader:
            items[LOADER] = ocp.args.JsonRestore()
        try:
            result = self._manager.restore(step, args=ocp.args.Composite(**items))
            leaves = jax.tree.leaves(result[STATE])
            tree = jax.tree.unflatten(jax.tree.structure(target), leaves)
        except Exception as error:  # Orbax raises many types for damaged files
            text = str(error).splitlines()[0] if str(error) else ""
            return None, f"restore failed: {type(error).__name__}: {text[:300]}"
        digests = state_digests(tree)
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
            from jddp import distributed

            distributed.barrier(f"checkpoint-set-aside-{step}", timeout_s=120)
        self._manager = self._open()


def _orbax_version() -> str:
    from importlib.metadata import version

    return version("orbax-checkpoint")
