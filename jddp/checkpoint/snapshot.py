"""In-memory snapshots of the training state, kept outside the training processes: a restart after a crash
restores from memory the newest step every process has, not the last checkpoint on disk.

Where they live: ``$JDDP_SNAPSHOT_DIR``, a directory in memory (tmpfs) that outlives the processes. ``jddp launch``
makes one per run under ``/dev/shm`` and removes it when the run ends; under another launcher (SLURM, Kubernetes)
set it to a directory of ``/dev/shm`` that the job removes at its end. A process that crashes leaves its snapshots
there; a host that dies takes them with it (the disk checkpoint is then the fallback).

Layout, per ``Checkpointer`` (its directory's hash) and process::

    <JDDP_SNAPSHOT_DIR>/<hash of the checkpoint directory>/process-<p>-of-<n>/<step>.snap

Each process keeps its newest ``KEEP`` complete snapshots. A snapshot is written into ``writing.tmp`` (the pages of
the oldest one, renamed, reused in place) and renamed to ``<step>.snap`` once complete: a kill at any instant leaves
the complete ones intact and a ``writing.tmp`` that nobody reads. Keeping two complete ones means that processes
whose writers are one snapshot apart still share a step.

A file: 8 bytes (little-endian header length), the header (JSON: the step, the process and device counts, the
config fingerprint, every leaf's path, shape and dtype, every local shard's index, offset and size, a CRC-32 of the
data, the loader position and ``extra``), then the data: the process's local shards (one copy of a replicated leaf,
each distinct shard of a split one), as bytes.

The cost: at a snapshot step, the main thread dispatches one program per local device that copies the shards into
one byte buffer (a copy no later step can donate), and hands it to a writer thread, which waits for it, takes its
CRC-32 and writes it to the file. The main thread flattens the state once per snapshot (an NNX state's flattening
runs in Python, per variable); which shards go where, and the header's JSON of it, are worked out once per state
structure and shardings (``benchmarks/snapshot_profile.py`` times each phase). The snapshot interval adapts to what
this costs: ``Snapshots.proposal`` is the number of steps between snapshots that keeps the measured time within
``budget`` of the step time; the processes agree on the largest proposal at their preemption exchanges
(``jddp.checkpoint.preemption``), so that they all take snapshots at the same steps. A snapshot's cost is the larger
of two measures: the time it takes of the main and writer threads, and what it adds to the wall time of the
``AFTER`` steps that follow it, over the time of steps further from any snapshot (``Snapshots.note_step``). The
second is what the run pays: the copy program and the writer also take cores that the step's own threads, or another
process of the host, would use (the MNIST-1D MLP under ``jddp launch -n 2`` on 2 cores: 2.5 to 3.9 ms by the first,
6.7 to 9.2 ms by the second; ``benchmarks/snapshot_cost.py --within``). The main thread runs steps ahead of the
devices (``max_inflight``), so the steps its clock sees slowed come up to 5 after the snapshot: ``AFTER`` is 6 (over
3 steps the second measure saw a quarter of the cost, and the snapshots took 2.3% of the step time at a budget of
1%). A step's time disturbed by a disk save (``disturbed``) counts in neither.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import shutil
import struct
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp import envvars
from jddp.checkpoint.errors import CheckpointWarning

FORMAT = 1
KEEP = 2  # complete snapshots kept per process
SUFFIX = ".snap"
WRITING = "writing.tmp"
SPARE = "spare.tmp"  # the oldest snapshot's file, kept for the next write to reuse its pages
MAX_INTERVAL = 10_000
AFTER = 6  # the steps after a snapshot whose wall time counts toward its cost (its copy and write overlap them)
_HEADER_LENGTH = struct.Struct("<Q")


class Unusable(Exception):
    """A snapshot that cannot be restored here; the message says why."""


def root() -> Path | None:
    """``$JDDP_SNAPSHOT_DIR``, or None when unset."""
    value = envvars.get("JDDP_SNAPSHOT_DIR")
    return Path(value) if value else None


def _key(directory) -> str:
    return hashlib.sha1(str(directory).encode()).hexdigest()[:16]


def choose(rows: np.ndarray) -> list[int]:
    """The snapshot steps a restore tries, newest first: those every process holds complete, not older than the
    newest checkpoint on disk.

    Args:
      rows: one row per process: its newest disk step (-1 for none), then its complete snapshot steps, -1 padded.
    """
    held = [{int(s) for s in row[1:] if s >= 0} for row in rows]
    newest_disk = max(int(row[0]) for row in rows)
    return sorted((s for s in set.intersection(*held) if s >= newest_disk), reverse=True)


def newest_held(rows: np.ndarray) -> tuple[int, int] | None:
    """``(step, process)``: the newest snapshot step that some process holds, not older than the newest checkpoint
    on disk, and the first process that holds it; None when there is none. ``rows`` as for ``choose``."""
    newest_disk = max(int(row[0]) for row in rows)
    held = [(int(s), p) for p, row in enumerate(rows) for s in row[1:] if s >= 0 and s >= newest_disk]
    if not held:
        return None
    step = max(s for s, _ in held)
    return step, min(p for s, p in held if s == step)


def _normal_index(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices) as ``((start, stop), ...)`` per dimension."""
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def _as_bytes(x: jax.Array) -> jax.Array:
    """``x``'s bytes, flat, as uint8 (bit-exact; a bool as 0/1)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).ravel()
    return jax.lax.bitcast_convert_type(x, jnp.uint8).ravel()


@jax.jit
def _pack(shards: list[jax.Array]) -> jax.Array:
    """The shards of one device, their bytes one after the other: a new buffer that no later step donates."""
    return jnp.concatenate([_as_bytes(x) for x in shards]) if shards else jnp.zeros((0,), jnp.uint8)


@dataclasses.dataclass
class _Layout:
    """Which local shards a state's snapshot holds, and where: computed once per state structure and shardings."""

    leaves: list[list]  # [path, shape, dtype, key implementation or None]
    shards: list[list]  # [leaf, index, device position, offset in its device's buffer, nbytes]
    # per device, in buffer order: (leaf, its local shard's position, or None where the leaf is on this one device
    # alone, and whether it is a PRNG key, whose key data is copied)
    picks: list[list[tuple[int, int | None, bool]]]
    whole: bool  # every leaf whole (replicated): every process of the host holds the same snapshot
    text: str = dataclasses.field(init=False)  # the header's "leaves" and "shards" as JSON, without its braces

    def __post_init__(self) -> None:
        self.text = json.dumps({"leaves": self.leaves, "shards": self.shards})[1:-1]


def _layout(tree) -> _Layout:
    paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves, shards, picks = [], [], []
    device_at: dict[Any, int] = {}
    offsets: list[int] = []
    for i, (path, x) in enumerate(paths_leaves):
        impl = None
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            data_dtype = jax.random.key_data(x).dtype
            data_shape = tuple(x.shape) + tuple(jax.random.key_data(x).shape[x.ndim :])
        else:
            data_dtype, data_shape = x.dtype, tuple(x.shape)
        leaves.append([jax.tree_util.keystr(path), list(data_shape), str(jnp.dtype(data_dtype)), impl])
        seen = set()
        for position, shard in enumerate(x.addressable_shards):
            # a PRNG key array's shard index may also cover its key data's dimensions (JAX 0.10 does): those are whole
            index = _normal_index(tuple(shard.index)[: x.ndim], tuple(x.shape)) + tuple(
                (0, n) for n in data_shape[x.ndim :]
            )
            if index in seen:
                continue
            seen.add(index)
            if shard.device not in device_at:
                device_at[shard.device] = len(picks)
                picks.append([])
                offsets.append(0)
            d = device_at[shard.device]
            nbytes = math.prod(b - a for a, b in index) * jnp.dtype(data_dtype).itemsize
            shards.append([i, [list(p) for p in index], d, offsets[d], nbytes])
            picks[d].append((i, position if len(x.sharding.device_set) > 1 else None, impl is not None))
            offsets[d] += nbytes
    whole = all([list(p) for p in index] == [[0, n] for n in leaves[leaf][1]] for leaf, index, *_ in shards)
    return _Layout(leaves, shards, picks, whole)


class _Clock:
    """Times a snapshot's phases into ``record`` (phase: [(seconds of wall time, of this thread's time)]), when
    given (``Snapshots.phases``: ``benchmarks/snapshot_profile.py``); else does nothing."""

    def __init__(self, record: dict[str, list[tuple[float, float]]] | None) -> None:
        self.record = record
        if record is not None:
            self.wall, self.cpu = time.perf_counter(), time.thread_time()

    def __call__(self, phase: str) -> None:
        if self.record is None:
            return
        wall, cpu = time.perf_counter(), time.thread_time()
        self.record.setdefault(phase, []).append((wall - self.wall, cpu - self.cpu))
        self.wall, self.cpu = wall, cpu


@dataclasses.dataclass
class _Pending:
    step: int
    buffers: list[jax.Array]
    header: dict  # without the layout's part
    layout: _Layout


class Snapshots:
    """One process's snapshots for one ``Checkpointer``; see the module docstring."""

    def __init__(
        self, base: Path, directory, *, fingerprint: str | None, budget: float, every: int | None = None
    ) -> None:
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.folder = Path(base) / _key(directory) / f"process-{self.process}-of-{self.processes}"
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / WRITING).unlink(missing_ok=True)  # a write a kill interrupted: never read
        self.fingerprint = fingerprint
        self.budget = budget
        self.every = every
        # jddp launch's index of this process on its host: of a replicated state, the processes of a host would
        # keep the same snapshot, so only the first does (the others get it from it at a restart: "peer")
        self.local_rank = envvars.get("JDDP_LOCAL_RANK")
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jddp-snapshot")
        self._pending: concurrent.futures.Future | None = None
        self._layouts: dict[Any, _Layout] = {}
        self._first = True
        self._cost_s: float | None = None  # per snapshot: main thread + writer thread + waiting for it
        self._wall_cost_s: float | None = None  # per snapshot: the wall time it adds to the steps after it
        self._step_s: float | None = None  # wall time per step, between calls of `note_step`
        self._clean_s: float | None = None  # the same, of steps more than AFTER steps from a snapshot
        self._last_call: tuple[int, float] | None = None
        self._taken_at: int | None = None  # the step of the last snapshot
        self._added_s = 0.0  # the wall time the steps since it took beyond `_clean_s`, so far
        self._disturbed_until = -1  # steps up to this one are not measured (a disk save's)
        self._clock = time.perf_counter  # the steps' clock (a test's own)
        self.taken = 0
        self.failed = 0
        self.seconds = 0.0
        self.closed = False
        self.phases: dict[str, list[tuple[float, float]]] | None = None  # set: each snapshot's phases timed

    # -------------------------------------------------------------- the interval
    def note_step(self, step: int) -> None:
        """Called once per step, before the step's snapshot if any: the step time the interval is measured
        against, and the wall time the last snapshot added to the steps after it."""
        now = self._clock()
        last, self._last_call = self._last_call, (step, now)
        if last is None or step <= last[0]:
            return
        per_step = (now - last[1]) / (step - last[0])
        self._step_s = per_step if self._step_s is None else 0.8 * self._step_s + 0.2 * per_step
        since = step - self._taken_at if self._taken_at is not None else None
        if step <= self._disturbed_until or step - last[0] > 1:
            if since is not None and since <= AFTER:
                self._taken_at = None  # this snapshot's steps are not all measured: no wall cost from it
            return
        if since is None or since > AFTER:
            self._clean_s = per_step if self._clean_s is None else 0.8 * self._clean_s + 0.2 * per_step
        elif self._clean_s is not None:
            self._added_s += per_step - self._clean_s
            if since == AFTER:
                added = max(self._added_s, 0.0)
                self._wall_cost_s = added if self._wall_cost_s is None else 0.8 * self._wall_cost_s + 0.2 * added

    def disturbed(self, step: int) -> None:
        """The steps through ``step + AFTER`` also carry other work (a disk save at ``step``): not measured."""
        self._disturbed_until = step + AFTER

    def proposal(self) -> int:
        """The steps between snapshots that keep their measured cost within ``budget`` of the step time (or the
        fixed ``every``)."""
        if self.every is not None:
            return self.every
        if self._cost_s is None or not self._step_s:
            return 1
        cost = max(self._cost_s, self._wall_cost_s or 0.0)
        return int(min(max(math.ceil(cost / (self.budget * self._step_s)), 1), MAX_INTERVAL))

    def _measured(self, seconds: float) -> None:
        self.seconds += seconds
        if self._first:  # the first one compiles the copy program: not what the next ones cost
            self._first = False
            return
        self._cost_s = seconds if self._cost_s is None else 0.8 * self._cost_s + 0.2 * seconds

    # -------------------------------------------------------------- taking
    def take(self, step: int, tree: dict, loader_state: Any, extra_state: Any) -> None:
        """Starts a snapshot of ``tree`` (the state's arrays by field) at ``step``; returns once the copy is
        dispatched. The previous snapshot's write is awaited first (one at a time). ``extra_state``: JSON, or a
        function the writer calls for it."""
        start = time.perf_counter()
        clock = _Clock(self.phases)
        waited = self._join()
        clock("join")
        # flattened once: a state of many NNX variables takes most of a snapshot's main-thread time to flatten
        leaves, treedef = jax.tree.flatten(tree)
        signature = (treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves))  # a layout is all three
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = _layout(tree)
        clock("signature")
        if layout.whole and self.local_rank:
            return
        # its wall cost is measured over the next AFTER steps (not the first's: it compiles the copy program)
        self._taken_at, self._added_s = (None if self._first else step), 0.0
        buffers = []
        for picks in layout.picks:
            parts = []
            for i, position, key in picks:
                data = leaves[i] if position is None else leaves[i].addressable_data(position)
                parts.append(jax.random.key_data(data) if key else data)
            clock("shards")
            buffers.append(_pack(parts))
            clock("dispatch")
        header = {
            "format": FORMAT,
            "step": step,
            "process": self.process,
            "processes": self.processes,
            "devices": jax.device_count(),
            "fingerprint": self.fingerprint,
            "loader": loader_state,
            "extra": extra_state,
        }
        main_s = time.perf_counter() - start - waited
        clock("header")
        self._pending = self._writer.submit(self._write, _Pending(step, buffers, header, layout), main_s + waited)

    def _join(self) -> float:
        """Waits for the write in flight; returns the seconds waited (a failed write only loses its snapshot)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        start = time.perf_counter()
        try:
            pending.result()
        except Exception as error:  # the snapshot is lost, not the run: the disk checkpoints remain
            if not self.failed:
                warnings.warn(
                    f"jddp could not write an in-memory snapshot to {self.folder} ({type(error).__name__}: {error}); "
                    "a restart restores an older snapshot or the checkpoint on disk. Is the memory file system "
                    "($JDDP_SNAPSHOT_DIR) full?",
                    CheckpointWarning,
                    stacklevel=4,
                )
            self.failed += 1
        return time.perf_counter() - start

    def _write(self, pending: _Pending, main_s: float) -> None:
        cpu = time.thread_time()
        clock = _Clock(self.phases)
        hosts = [np.asarray(b) for b in pending.buffers]  # waits for the copies; a view, no copy, on CPU
        clock("copy wait")
        if callable(pending.header["extra"]):  # an extra state to read now (Checkpointer.maybe_save)
            pending.header["extra"] = pending.header["extra"]()
        clock("extra")
        crc = 0
        for h in hosts:
            crc = zlib.crc32(h.data, crc)
        clock("crc32")
        header = dict(pending.header, crc32=crc, sizes=[int(h.nbytes) for h in hosts], time=time.time())
        text = (json.dumps(header)[:-1] + ", " + pending.layout.text + "}").encode()  # the layout's JSON made once
        clock("json")
        start = _HEADER_LENGTH.size + len(text)
        total = start + sum(h.nbytes for h in hosts)
        target = self.folder / WRITING
        spare = self.folder / SPARE
        if spare.exists():
            os.replace(spare, target)  # the oldest snapshot's pages, overwritten in place
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, total)
            os.pwrite(fd, _HEADER_LENGTH.pack(len(text)) + text, 0)
            offset = start
            for h in hosts:
                if h.nbytes:
                    os.pwrite(fd, h.data.cast("B"), offset)
                offset += h.nbytes
        finally:
            os.close(fd)
        clock("write")
        os.replace(target, self.folder / f"{pending.step}{SUFFIX}")
        complete = self.steps()
        for old in complete[KEEP:]:
            os.replace(self.folder / f"{old}{SUFFIX}", spare)
        clock("rename")
        self.taken += 1
        self._measured(main_s + time.thread_time() - cpu)

    def wait(self) -> None:
        self._join()

    # -------------------------------------------------------------- reading
    def steps(self) -> list[int]:
        """The steps of this process's complete snapshots, newest first."""
        found = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        for name in names:
            if name.endswith(SUFFIX) and name[: -len(SUFFIX)].isdigit():
                found.append(int(name[: -len(SUFFIX)]))
        return sorted(found, reverse=True)

    def load(self, step: int, tree: dict, fingerprint: str | None) -> tuple[dict, Any, Any]:
        """``(arrays by field in tree's shardings, loader position, extra state)`` of the snapshot at ``step``.

        Raises:
          Unusable: the snapshot does not fit ``tree`` (another model, config, process or device count, or
            sharding) or its data does not match its CRC-32.
        """
        path = self.folder / f"{step}{SUFFIX}"
        try:
            return decode(np.fromfile(path, np.uint8), step, tree, fingerprint)
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as error:
            raise Unusable(f"snapshot {path} cannot be read ({type(error).__name__}: {error})") from error

    def read_for_peers(self, step: int, tree: dict, fingerprint: str | None, *, path: Path | None = None) -> np.ndarray:
        """The file of the snapshot at ``step`` as bytes, for processes that hold none (their host's memory was
        lost): checked as ``load`` checks it, and only a snapshot of whole arrays (each process holds one copy of
        every leaf; a split one, ZeRO-1's, holds only this process's part). ``path``: one of ``others()``'s.

        Raises:
          Unusable: as ``load``, or when the snapshot holds parts of split leaves.
        """
        path = path or self.folder / f"{step}{SUFFIX}"
        try:
            file = np.fromfile(path, np.uint8)
            decode(file, step, tree, fingerprint, whole=True)
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as error:
            raise Unusable(f"snapshot {path} cannot be read ({type(error).__name__}: {error})") from error
        return file

    def others(self) -> dict[int, Path]:
        """``{step: file}`` of the complete snapshots that processes of another process count left on this host
        (an elastic run's round before, ``jddp launch --nnodes MIN:MAX``): one per step, newest first."""
        found: dict[int, Path] = {}
        for folder in sorted(self.folder.parent.glob("process-*-of-*")):
            if folder.name.endswith(f"-of-{self.processes}"):
                continue
            for name in os.listdir(folder) if folder.is_dir() else []:
                if name.endswith(SUFFIX) and name[: -len(SUFFIX)].isdigit():
                    found.setdefault(int(name[: -len(SUFFIX)]), folder / name)
        return dict(sorted(found.items(), reverse=True))

    def forget_others(self) -> None:
        """Removes ``others()``'s folders: once a restore is agreed, they hold another round's timeline."""
        for folder in self.folder.parent.glob("process-*-of-*"):
            if not folder.name.endswith(f"-of-{self.processes}"):
                shutil.rmtree(folder, ignore_errors=True)

    def drop_after(self, step: int) -> None:
        """Removes this process's snapshots newer than ``step`` (the restored one): another timeline's."""
        for s in self.steps():
            if s > step:
                (self.folder / f"{s}{SUFFIX}").unlink(missing_ok=True)

    # -------------------------------------------------------------- closing
    def close(self, *, remove: bool) -> None:
        """Waits for the write in flight; ``remove``: the snapshots are not needed any more (a run that ended)."""
        if self.closed:
            return
        self.closed = True
        self._join()
        self._writer.shutdown()
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
            try:
                self.folder.parent.rmdir()  # the last process's removal empties it
            except OSError:
                pass


def decode(file: np.ndarray, step: int, tree: dict, fingerprint: str | None, *, whole: bool = False):
    """``(arrays by field in tree's shardings, loader position, extra state)`` of a snapshot file's bytes.

    Raises:
      Unusable: see ``Snapshots.load``; with ``whole``, also for a snapshot that holds parts of split leaves.
    """
    (length,) = _HEADER_LENGTH.unpack_from(file.data, 0)
    header = json.loads(file[_HEADER_LENGTH.size : _HEADER_LENGTH.size + length].tobytes())
    if header.get("format") != FORMAT or header.get("step") != step:
        raise Unusable(f"snapshot of step {step}: format {header.get('format')}, step {header.get('step')}")
    here: dict[str, Any] = {"fingerprint": fingerprint}
    if not whole:  # a snapshot of whole leaves restores onto any process and device count, as a checkpoint does
        here.update(processes=jax.process_count(), devices=jax.device_count())
    for name, value in here.items():
        if header.get(name) != value:
            raise Unusable(f"snapshot of step {step} has {name} {header.get(name)!r}, here {value!r}")
    layout = _layout(tree)
    if [lf[:3] for lf in header["leaves"]] != [lf[:3] for lf in layout.leaves]:
        raise Unusable(f"snapshot of step {step} holds another state (leaves' paths, shapes or dtypes differ)")
    start = _HEADER_LENGTH.size + length
    data = file[start : start + sum(header["sizes"])]
    if data.size != sum(header["sizes"]):
        raise Unusable(f"snapshot of step {step} is cut short ({file.size} bytes)")
    if zlib.crc32(data.data) != header["crc32"]:
        raise Unusable(f"snapshot of step {step} is damaged (CRC-32 mismatch)")
    if whole and any(
        list(map(tuple, index)) != [(0, n) for n in header["leaves"][leaf][1]] for leaf, index, *_ in header["shards"]
    ):
        raise Unusable(f"snapshot of step {step} holds parts of split leaves (ZeRO-1): it restores only its process")
    device_starts = np.cumsum([0, *header["sizes"]])
    by_leaf: dict[int, dict[tuple, np.ndarray]] = {}
    for leaf, index, device, offset, nbytes in header["shards"]:
        name, _, dtype, _ = header["leaves"][leaf]
        shape = tuple(b - a for a, b in index)
        raw = data[device_starts[device] + offset : device_starts[device] + offset + nbytes]
        value = raw.astype(np.bool_) if dtype == "bool" else raw.view(jnp.dtype(dtype))
        by_leaf.setdefault(leaf, {})[tuple(tuple(p) for p in index)] = value.reshape(shape)
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for i, x in enumerate(leaves):
        shards = by_leaf.get(i, {})
        impl = header["leaves"][i][3]
        extra_dims = tuple((0, n) for n in header["leaves"][i][1][x.ndim :])

        def piece(index, x=x, shards=shards, extra_dims=extra_dims):
            key = _normal_index(index, tuple(x.shape)) + extra_dims
            if key not in shards:
                raise Unusable(f"snapshot of step {step} lacks the shard {key} of a leaf (another sharding)")
            return shards[key]

        if impl is not None:
            data_shape = tuple(header["leaves"][i][1])
            sharding = jax.random.key_data(x).sharding
            rank = x.ndim
            raw = jax.make_array_from_callback(data_shape, sharding, lambda index, p=piece, r=rank: p(index[:r]))  # pyright: ignore[reportOptionalSubscript]
            out.append(jax.random.wrap_key_data(raw, impl=jax.random.key_impl(x)))
        else:
            out.append(jax.make_array_from_callback(tuple(x.shape), x.sharding, piece))
    return jax.tree.unflatten(treedef, out), header.get("loader"), header.get("extra")
