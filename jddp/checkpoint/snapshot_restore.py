"""Restoring from the in-memory snapshots (``jddp.checkpoint.snapshot``), agreed by every process: the newest step
they all hold, else the newest one some process holds (or a group of another process count left on the hosts),
sent to the others over the devices. ``Checkpointer.restore_or_init`` tries this first, then the disk."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jddp.checkpoint import preemption, restore, snapshot, snapshot_format
from jddp.checkpoint.errors import CheckpointWarning
from jddp.runtime import watchdog
from jddp.runtime.state import TrainState

# (the restored state, the loader position, the extra state, the step)
Restored = tuple[TrainState, Any, Any, int]


def from_memory(
    snaps: snapshot.Snapshots | None,
    state: TrainState,
    fingerprint: str | None,
    latest_step: Callable[[], int | None],
    run: str | None = None,
    loader=None,
) -> tuple[Restored, str] | None:
    """The newest in-memory snapshot step that every process holds complete and that is not older than the
    newest checkpoint on disk (``latest_step``), restored as ``restore.try_restore`` restores a disk step, and
    where it came from (``"memory"``, or ``"peer"``: see ``from_a_peer``); None when there is none (or none loads
    on every process). The steps and the outcome are agreed with collectives. ``run``: the checkpoint directory's
    run id; a snapshot of another run (or config fingerprint) is refused with a warning naming both, and removed."""
    if snaps is None and jax.process_count() == 1:
        return None
    mine = snaps.steps()[: 2 * snapshot.KEEP] if snaps is not None else []
    newest_disk = latest_step()
    row = np.full(1 + 2 * snapshot.KEEP, -1, np.int32)
    row[0] = -1 if newest_disk is None else newest_disk
    row[1 : 1 + len(mine)] = mine
    rows = _gathered(row)
    common = snapshot.choose(rows)
    newest = snapshot.newest_held(rows) if jax.process_count() > 1 else None
    from_peer = newest is not None and newest[0] > (common[0] if common else -1)
    if from_peer and common:
        # the survivors of a failure wrote a newer step than every process holds (their kept step: snapshot_kept)
        restored = from_a_peer(snaps, state, fingerprint, rows, run, loader, then="trying an older snapshot")
        if restored is not None:
            return restored, "peer"
    for step in common:
        assert snaps is not None  # every process holds the step
        try:
            tree, loader_state, extra_state = snaps.load(step, restore.as_dict(state), fingerprint)
            reason = _loader_problem(loader, loader_state, snaps.folder / f"{step}{snapshot.SUFFIX}")
        except snapshot_format.OtherRun as error:
            reason = str(error)
            snaps.discard(step)
        except snapshot_format.Unusable as error:
            reason = str(error)
        if preemption.all_agree(reason is None):
            snaps.drop_after(step)
            return (TrainState(**tree, opt_layout=state.opt_layout), loader_state, extra_state, step), "memory"
        _warn(
            f"The in-memory snapshot of step {step} cannot be used ({reason or 'not on another process'}); "
            "trying an older one, then the checkpoints on disk."
        )
    restored = None if from_peer and common else from_a_peer(snaps, state, fingerprint, rows, run, loader)
    return None if restored is None else (restored, "peer")


def from_a_peer(
    snaps: snapshot.Snapshots | None,
    state: TrainState,
    fingerprint: str | None,
    rows: np.ndarray,
    run: str | None,
    loader=None,
    then: str = "restoring from the checkpoints on disk",
) -> Restored | None:
    """When no step is held by every process (a process whose host's memory was lost, a replaced host), or a
    newer one is held by some (the survivors of a failure wrote their kept step): the newest step some process
    holds, not older than the disk's, sent to every process from the first that holds it. Each process of a
    data-parallel run holds every leaf whole, so any process is every other's buddy, at no cost while training; a
    state split over the processes (ZeRO-1) is restored from disk.

    Args:
      rows: ``from_memory``'s gathered rows (``snapshot.choose``'s argument).
      then: what follows when it cannot be used, for the warning.
    """
    found = snapshot.newest_held(rows) if jax.process_count() > 1 else None
    other: Path | None = None  # the file of another process count's snapshot, on the holder
    if found is None:
        found, other = _held_by_another_count(snaps, rows)
        if found is None:
            return None
    step, holder = found
    blob, reason = _sent(snaps, step, holder, restore.as_dict(state), fingerprint, other)
    if blob is None:
        _warn(
            f"The in-memory snapshot of step {step} on process {holder} cannot be sent to the processes that "
            f"lack one ({reason or 'see that process'}); {then}."
        )
        return None
    try:
        tree, loader_state, extra_state = snapshot_format.decode(
            blob, step, restore.as_dict(state), fingerprint, run=run, whole=True
        )
        reason = _loader_problem(loader, loader_state, f"the snapshot of step {step} sent by process {holder}")
    except snapshot_format.Unusable as error:
        reason = str(error)
    if not preemption.all_agree(reason is None):
        _warn(
            f"The in-memory snapshot of step {step} sent by process {holder} cannot be used "
            f"({reason or 'on another process'}); {then}."
        )
        return None
    if snaps is not None:
        snaps.drop_after(step)
    return TrainState(**tree, opt_layout=state.opt_layout), loader_state, extra_state, step


def _held_by_another_count(
    snaps: snapshot.Snapshots | None, rows: np.ndarray
) -> tuple[tuple[int, int] | None, Path | None]:
    """A group of another process count (an elastic run's next round, jddp launch --nnodes MIN:MAX): the
    snapshots the round before left on the hosts, of whole leaves, restore onto any count. ``(step, holder)`` of
    the newest, as ``snapshot.newest_held``, and its file when this process holds it."""
    others = snaps.others() if snaps is not None else {}
    row = np.full(1 + 2 * snapshot.KEEP, -1, np.int32)
    held = list(others)[: 2 * snapshot.KEEP]
    row[1 : 1 + len(held)] = held
    other_rows = _gathered(row)
    other_rows[:, 0] = rows[:, 0]  # each process's newest step on disk, as gathered before
    found = snapshot.newest_held(other_rows)
    if found is None:
        return None, None
    return found, others[found[0]] if found[1] == jax.process_index() else None


def _sent(
    snaps: snapshot.Snapshots | None, step: int, holder: int, tree: dict, fingerprint: str | None, other: Path | None
) -> tuple[np.ndarray | None, str | None]:
    """The holder's snapshot file of ``step`` as bytes on every process (broadcast over the devices); None and the
    holder's reason when it cannot be sent."""
    from jax.experimental import multihost_utils

    mine = holder == jax.process_index()
    file, reason = np.zeros(0, np.uint8), None
    if mine:
        assert snaps is not None  # it listed the step
        try:
            file = snaps.read_for_peers(step, tree, fingerprint, path=other)
        except snapshot_format.Unusable as error:
            reason = str(error)
    size = np.asarray([file.size if mine and reason is None else -1], np.int32)
    with watchdog.waiting():
        size = int(multihost_utils.broadcast_one_to_all(size, is_source=mine)[0])
    if size < 0:
        return None, reason
    with watchdog.waiting():
        blob = multihost_utils.broadcast_one_to_all(file if mine else np.zeros(size, np.uint8), is_source=mine)
    return np.asarray(blob, np.uint8), None


def _loader_problem(loader, loader_state, where) -> str | None:
    """Why a snapshot's loader position cannot be used by ``loader`` (``restore.loader_state_problem``), naming
    the snapshot; None when it can, or when nothing is restored into a loader."""
    if loader is None or loader_state is None:
        return None
    why = restore.loader_state_problem(loader_state, loader.get_state())
    return None if why is None else f"{where}: its loader position holds {why}"


def _gathered(row: np.ndarray) -> np.ndarray:
    """Every process's ``row``, one per process (``row[None]`` alone): an all-gather in a group."""
    rows = row[None]
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        with watchdog.waiting():
            rows = np.array(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)
    return rows


def _warn(message: str) -> None:
    """A ``CheckpointWarning`` pointed at ``restore_or_init``'s caller, as the Checkpointer's own warnings are."""
    warnings.warn(message, CheckpointWarning, stacklevel=6)
