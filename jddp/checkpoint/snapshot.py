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

A file's format is ``jddp.checkpoint.snapshot_format``'s.

The cost: at a snapshot step, the main thread dispatches one program per local device that copies the shards into
one byte buffer (a copy no later step can donate), and hands it to a writer thread, which waits for it, takes its
CRC-32 and writes it to the file. The main thread flattens the state once per snapshot (an NNX state's flattening
runs in Python, per variable); which shards go where, and the header's JSON of it, are worked out once per state
structure and shardings (``benchmarks/snapshot_profile.py`` times each phase). The steps between snapshots adapt
to what this costs: ``jddp.checkpoint.snapshot_interval``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import time
import warnings
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jddp import envvars
from jddp.checkpoint import snapshot_format, snapshot_interval, snapshot_kept
from jddp.checkpoint.errors import CheckpointWarning
from jddp.runtime import flush

KEEP = 2  # complete snapshots kept per process
SUFFIX = ".snap"
WRITING = "writing.tmp"
SPARE = "spare.tmp"  # the oldest snapshot's file, kept for the next write to reuse its pages
FLUSHING = "flushing.tmp"  # a kept step written as the process is ended (write_kept): never read
# the format's and the interval's names, where they were first defined
FORMAT = snapshot_format.FORMAT
Unusable = snapshot_format.Unusable
decode = snapshot_format.decode
MAX_INTERVAL = snapshot_interval.MAX_INTERVAL
AFTER = snapshot_interval.AFTER


def root() -> Path | None:
    """``$JDDP_SNAPSHOT_DIR``, or None when unset."""
    value = envvars.get("JDDP_SNAPSHOT_DIR")
    return Path(value) if value else None


def _key(directory) -> str:
    return hashlib.sha1(str(directory).encode()).hexdigest()[:16]


def _remove(path: Path) -> None:
    """Removes a snapshot's file, or a directory found in its place (damage)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
    buffers: list[jax.Array | list[jax.Array]]  # per device: pack's buffer, or copies' (a step only kept)
    header: dict  # without the layout's part
    layout: snapshot_format.Layout


def _on_host(buffer) -> bool:
    """Whether ``buffer`` is in host memory already (CPU devices: ``np.asarray`` is a view, nothing to copy)."""
    return all(d.platform == "cpu" for d in buffer.devices())


class Snapshots(snapshot_interval.Interval):
    """One process's snapshots for one ``Checkpointer``; see the module docstring."""

    def __init__(
        self,
        base: Path,
        directory,
        *,
        fingerprint: str | None,
        budget: float,
        every: int | None = None,
        run: str | None = None,
    ) -> None:
        self.process, self.processes = jax.process_index(), jax.process_count()
        self.folder = Path(base) / _key(directory) / f"process-{self.process}-of-{self.processes}"
        self.folder.mkdir(parents=True, exist_ok=True)
        for temporary in (WRITING, FLUSHING):
            (self.folder / temporary).unlink(missing_ok=True)  # a write a kill interrupted: never read
        super().__init__(budget=budget, every=every)
        self.fingerprint = fingerprint
        self.run = run  # the checkpoint directory's run id (jddp.checkpoint.identity), in every header
        # jddp launch's index of this process on its host: of a replicated state, the processes of a host would
        # keep the same snapshot, so only the first does (the others get it from it at a restart: "peer")
        self.local_rank = envvars.get("JDDP_LOCAL_RANK")
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jddp-snapshot")
        self._pending: concurrent.futures.Future | None = None
        self._layouts: dict[Any, snapshot_format.Layout] = {}
        self.taken = 0
        self.failed = 0
        self.closed = False
        self.phases: dict[str, list[tuple[float, float]]] | None = None  # set: each snapshot's phases timed
        self.kept = snapshot_kept.Kept(self.processes)  # the newest steps' copies, for write_kept
        flush.at_flush(self.write_kept)

    # -------------------------------------------------------------- taking
    @property
    def keeps(self) -> bool:
        """Whether every step's copy is kept (``take(..., write=False)``): decided by the first state's layout."""
        return self.kept.depth > 0 or not self._layouts

    def take(self, step: int, tree: dict, loader_state: Any, extra_state: Any, *, write: bool = True) -> None:
        """Starts a snapshot of ``tree`` (the state's arrays by field) at ``step``; returns once the copy is
        dispatched. The previous snapshot's write is awaited first (one at a time). ``extra_state``: JSON, or a
        function the writer calls for it. ``write=False``: the copy is only kept (``keeps``), not written."""
        start = time.perf_counter()
        clock = _Clock(self.phases)
        waited = self._join() if write else 0.0
        clock("join")
        # flattened once: a state of many NNX variables takes most of a snapshot's main-thread time to flatten
        leaves, treedef = jax.tree.flatten(tree)
        signature = (treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves))  # a layout is all three
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = snapshot_format.shard_layout(tree)
            self.kept.fit(layout, leaves)
        clock("signature")
        keep = self.kept.depth > 0 and layout.whole
        if layout.whole and self.local_rank:
            write = False
        if not (write or keep):
            return
        if write:
            self._started(step)
        buffers = []
        for picks in layout.picks:
            parts = []
            for i, position, key in picks:
                data = leaves[i] if position is None else leaves[i].addressable_data(position)
                parts.append(jax.random.key_data(data) if key else data)
            clock("shards")
            if not write:  # only kept: one buffer per shard, joined on the host if the flush writes it
                buffers.append(snapshot_format.copies(parts))
                clock("dispatch")
                continue
            buffer = snapshot_format.pack(parts)
            if not _on_host(buffer):
                # On an accelerator the buffer lives in device memory: its copy to the host starts now, beside the
                # next steps, and the writer thread's np.asarray waits for it off the main thread. Its cost reaches
                # the interval's cost model both ways (the writer's time; the wall time of the steps after it).
                buffer.copy_to_host_async()
            buffers.append(buffer)
            clock("dispatch")
        header = {
            "format": snapshot_format.FORMAT,
            "step": step,
            "process": self.process,
            "processes": self.processes,
            "devices": jax.device_count(),
            "fingerprint": self.fingerprint,
            "run": self.run,
            "loader": loader_state,
            "extra": extra_state,
        }
        pending = _Pending(step, buffers, header, layout)
        if keep:
            self.kept.add(pending)
        clock("header")
        if write:
            main_s = time.perf_counter() - start - waited
            self._pending = self._writer.submit(self._write, pending, main_s + waited)

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
        self._write_file(pending, WRITING, clock)
        complete = self.steps()
        for old in complete[KEEP:]:
            if (self.folder / f"{old}{SUFFIX}").is_dir():  # a directory in a snapshot's place: never a spare
                _remove(self.folder / f"{old}{SUFFIX}")
                continue
            os.replace(self.folder / f"{old}{SUFFIX}", self.folder / SPARE)
        clock("rename")
        self.taken += 1
        self._measured(main_s + time.thread_time() - cpu)

    def _write_file(self, pending: _Pending, temporary: str, clock: _Clock, hosts: list | None = None) -> None:
        """Writes ``pending`` into ``temporary`` (the pages of ``SPARE`` reused, for ``WRITING``), renamed to its
        step's name once complete. ``hosts``: its buffers on the host, when read already."""
        if hosts is None:
            hosts = [snapshot_format.joined(b) for b in pending.buffers]  # waits; on CPU, a view of pack's
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
        start = snapshot_format.HEADER_LENGTH.size + len(text)
        total = start + sum(h.nbytes for h in hosts)
        target = self.folder / temporary
        spare = self.folder / SPARE
        if temporary == WRITING and spare.exists():
            os.replace(spare, target)  # the oldest snapshot's pages, overwritten in place
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, total)
            os.pwrite(fd, snapshot_format.HEADER_LENGTH.pack(len(text)) + text, 0)
            offset = start
            for h in hosts:
                if h.nbytes:
                    os.pwrite(fd, h.data.cast("B"), offset)
                offset += h.nbytes
        finally:
            os.close(fd)
        clock("write")
        os.replace(target, self.folder / f"{pending.step}{SUFFIX}")

    def write_kept(self) -> int | None:
        """Writes the newest kept step whose copy is complete and holds no error, when newer than every complete
        snapshot here (see ``jddp.checkpoint.snapshot_kept``); returns its step, None when there is none. Called by
        the survivors of a failure as they are ended (``jddp.runtime.flush``), from any thread, while the main
        thread may be blocked in a collective or still running."""
        newest = max(self.steps(), default=-1)
        for pending in self.kept.complete(newest, wait_s=snapshot_kept.FLUSH_WAIT_S):
            try:
                hosts = [snapshot_format.joined(b) for b in pending.buffers]
            except Exception:  # a step that failed (its collective's peer gone): its copy holds the error
                continue
            self._write_file(pending, FLUSHING, _Clock(None), hosts)
            return pending.step
        return None

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
            return decode(np.fromfile(path, np.uint8), step, tree, fingerprint, run=self.run)
        except snapshot_format.Unusable as error:
            raise type(error)(f"{path}: {error}") from error
        except (OSError, *snapshot_format.DAMAGE) as error:
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
            decode(file, step, tree, fingerprint, run=self.run, whole=True)
        except snapshot_format.Unusable as error:
            raise type(error)(f"{path}: {error}") from error
        except (OSError, *snapshot_format.DAMAGE) as error:
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

    def discard(self, step: int) -> None:
        """Removes this process's snapshot of ``step`` (another run's: it can never be restored here)."""
        _remove(self.folder / f"{step}{SUFFIX}")

    def drop_after(self, step: int) -> None:
        """Removes this process's snapshots newer than ``step`` (the restored one): another timeline's."""
        for s in self.steps():
            if s > step:
                _remove(self.folder / f"{s}{SUFFIX}")

    # -------------------------------------------------------------- closing
    def close(self, *, remove: bool) -> None:
        """Waits for the write in flight; ``remove``: the snapshots are not needed any more (a run that ended)."""
        if self.closed:
            return
        self.closed = True
        flush.forget(self.write_kept)
        self._join()
        self._writer.shutdown()
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
            try:
                self.folder.parent.rmdir()  # the last process's removal empties it
            except OSError:
                pass
