"""The newest steps kept on the devices, for the survivors of a failure to write as they are ended: a restart
recomputes no step the group had completed, whatever the snapshot interval.

In-memory snapshots are written every few steps (``jddp.checkpoint.snapshot_interval`` keeps their cost within
its budget of the step time: about 20 steps apart for a 15-ms step), so a restart from the newest one recomputes up
to that many. Yet when one process of a group dies, its peers have completed the newest step the group completed:
the next step's collective waits for the dead one, or fails (gloo: "Connection reset by peer"). Only their state of
that step is gone: the next step donated its buffers.

So at each step ``Checkpointer.maybe_save`` dispatches a copy of the state's bytes (``snapshot_format.copies``: one
buffer per shard that no later step donates, joined on the host into a snapshot's buffer only if it is written) and
keeps the newest ``depth`` of them: the main thread runs up
to ``max_inflight`` steps ahead of the devices (``jddp.runtime.dispatch``), so ``max_inflight + 1`` kept steps
always include the newest one the devices completed. When ``jddp launch`` ends the survivors for a restart
(``jddp.runtime.flush``'s signal), each writes the newest kept step whose copy is complete and holds no error (a
failed step's copy holds the step's error), when newer than its snapshots, as a snapshot
(``Snapshots.write_kept``). The restore takes the newest step any process holds and sends it to the others
(``jddp.checkpoint.snapshot_restore``).

Kept only for a state of whole (replicated) leaves in a group of processes: of a split state (ZeRO-1) the dead
process's part is lost with it; a process alone has no survivor. The cost: ``depth`` copies of the state in each
device's memory, and one copy program per local device per step. ``$JDDP_KEEP_STEPS`` decides: ``auto`` (the
default) keeps them where they fit (``fits``), ``on`` always, ``off`` never.

Example:
  >>> fits(depth=3, state_bytes=4_000_000, memory={"bytes_limit": 80 << 30, "peak_bytes_in_use": 60 << 30})
  True
  >>> fits(depth=3, state_bytes=4 << 30, memory={"bytes_limit": 80 << 30, "peak_bytes_in_use": 60 << 30})
  False
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import jax

from jddp import envvars
from jddp.runtime import dispatch

HEADROOM_SHARE = 0.5  # of a device's memory that its first steps left free, what the kept copies may take
HOST_SHARE = 0.25  # of the host memory available, what the kept copies of CPU devices may take
# How long the flush waits for kept copies not yet complete before it writes an older one: a step complete whose
# copy has yet to run (a loaded host), against a step that never completes (a collective hung, without an error).
FLUSH_WAIT_S = 0.25


def fits(depth: int, state_bytes: int, memory: dict[str, int] | None, available_host: int | None = None) -> bool:
    """Whether ``depth`` copies of ``state_bytes`` (one device's part of the state) fit: within ``HEADROOM_SHARE``
    of what the device's peak use so far left of its limit (``memory``: ``Device.memory_stats()``), or, for a
    device without such figures (CPU), within ``HOST_SHARE`` of ``available_host`` bytes."""
    need = depth * state_bytes
    if memory and memory.get("bytes_limit"):
        free = memory["bytes_limit"] - memory.get("peak_bytes_in_use", memory.get("bytes_in_use", 0))
        return need <= HEADROOM_SHARE * free
    return available_host is not None and need <= HOST_SHARE * available_host


def _memory(leaves: list[jax.Array]) -> dict[str, int] | None:
    """The memory figures of the state's first device (``Device.memory_stats``: GPU and TPU; None on CPU)."""
    device = next(iter(leaves[0].sharding.addressable_devices)) if leaves else None
    return device.memory_stats() if device is not None else None


def _available_host() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


class Kept:
    """One process's kept steps (``Snapshots.kept``): ``depth`` is 0 until a state's layout shows they are wanted
    (``fit``). Entries are ``snapshot._Pending``: the step, its buffers, its header and layout."""

    def __init__(self, processes: int) -> None:
        self.setting: str = envvars.get("JDDP_KEEP_STEPS")
        self.processes = processes
        self.depth = 0
        self._entries: list[Any] = []
        self._lock = threading.Lock()  # add (main thread) against complete (the flush thread)

    def fit(self, layout, leaves: list[jax.Array]) -> None:
        """Decides ``depth`` for a state of this ``layout`` (a new one after a change of structure or sharding)."""
        depth = dispatch.DISPATCHER.ahead + 1
        if self.setting == "off" or self.processes < 2 or not layout.whole:
            self.depth = 0
        elif self.setting == "on":
            self.depth = depth
        else:
            state_bytes = sum(int(x.nbytes) for x in leaves)  # whole leaves: each device holds them all
            memory = _memory(leaves)
            host = _available_host()
            if host is not None and not memory:  # CPU devices: the copies of every device a snapshot reads share it
                host //= max(1, len(layout.picks))
            self.depth = depth if fits(depth, state_bytes, memory, host) else 0
        with self._lock:
            self._entries.clear()

    def add(self, pending) -> None:
        """Keeps ``pending`` (the newest step), dropping the oldest beyond ``depth`` (their buffers freed)."""
        with self._lock:
            self._entries.append(pending)
            if len(self._entries) > self.depth:
                del self._entries[: len(self._entries) - self.depth]

    def complete(self, newer_than: int, wait_s: float = 0.0) -> list:
        """The kept steps newer than ``newer_than`` whose copies are complete, newest first, once every newer one
        is complete too or ``wait_s`` seconds have passed (a copy dispatched after its step: its step may be
        complete and the copy still to run, on a loaded host; a step that hangs never completes). A complete copy
        may still hold an error (its step failed: the peer of its collective died): reading it raises."""
        with self._lock:
            entries = list(self._entries)
        newer = [p for p in reversed(entries) if p.step > newer_than]
        deadline = time.monotonic() + wait_s
        while True:
            done = [p for p in newer if all(b.is_ready() for b in jax.tree.leaves(p.buffers))]
            if len(done) == len(newer) or time.monotonic() >= deadline:
                return done
            time.sleep(0.005)
