"""The snapshots' interval (``jddp.checkpoint.snapshot.Snapshots.proposal``): sized by what a snapshot adds to the
wall time of the steps after it, not only by the threads' own time, and not by a disk save's time.

A step clock of the test's own drives ``note_step``: steps of ``STEP_S``, each snapshot adding ``ADDED`` to the
steps after it, a disk save adding ``SAVE_S`` to the step after it; the reference is the arithmetic below.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from jddp.checkpoint import snapshot

STEP_S = 0.010
# What a snapshot adds to each of the AFTER steps after it, 6 ms in all: the main thread runs steps ahead of the
# devices, so the steps its clock sees slowed come up to 5 later (BENCHMARKS.md section 13: a measure over the 3
# steps after it saw a quarter of the cost; red with AFTER = 3 here).
ADDED = (0.0005, 0.001, 0.0015, 0.0015, 0.001, 0.0005)
SAVE_S = 0.050


def run(tmp_path, *, every: int, save_every: int | None, disturbed: bool, steps: int = 400):
    snaps = snapshot.Snapshots(tmp_path / "memory", tmp_path / "ckpt", fingerprint=None, budget=0.01)
    clock = [0.0]
    snaps._clock = lambda: clock[0]
    tree = {"params": jnp.arange(1000.0)}
    taken = saved = -(10**9)
    for step in range(1, steps + 1):
        after = step - taken
        clock[0] += STEP_S + (ADDED[after - 1] if 1 <= after <= len(ADDED) else 0.0)
        clock[0] += SAVE_S if step - saved == 1 else 0.0
        snaps.note_step(step)
        if save_every and step % save_every == 0:
            saved = step
            if disturbed:
                snaps.disturbed(step)
        if step % every == 0:
            snaps.take(step, tree, None, None)
            snaps.wait()
            taken = step
    snaps.close(remove=True)
    return snaps


def test_the_wall_time_a_snapshot_adds_sizes_the_interval(tmp_path):
    assert len(ADDED) == snapshot.AFTER
    snaps = run(tmp_path, every=20, save_every=None, disturbed=False)
    # every clean step is STEP_S (after the first snapshot's, which is not measured, and whose added time the
    # baseline forgets within a few steps): each snapshot's measure is sum(ADDED), and so is their average
    assert snaps._clean_s == pytest.approx(STEP_S, rel=1e-3)
    assert snaps._wall_cost_s == pytest.approx(sum(ADDED), rel=1e-2)
    assert snaps._cost_s is not None and snaps._cost_s < sum(ADDED)  # the threads' own time: less, here
    # the proposal keeps sum(ADDED) per snapshot within 1% of the mean step time (STEP_S and the added time)
    assert snaps._step_s is not None and STEP_S <= snaps._step_s <= STEP_S + max(ADDED)
    assert snaps.proposal() == math.ceil(sum(ADDED) / (0.01 * snaps._step_s))
    assert snaps.proposal() >= math.ceil(sum(ADDED) / (0.01 * (STEP_S + max(ADDED))))


def test_a_disk_save_at_a_snapshot_step_is_not_counted_as_its_cost(tmp_path):
    # a save every 40 steps falls on every other snapshot step (every 20): its 50 ms, after the snapshot too
    clean = run(tmp_path / "a", every=20, save_every=40, disturbed=True)
    assert clean._wall_cost_s == pytest.approx(sum(ADDED), rel=1e-2)
    counted = run(tmp_path / "b", every=20, save_every=40, disturbed=False)  # what it would be without `disturbed`
    assert counted._wall_cost_s is not None and counted._wall_cost_s > 2 * sum(ADDED)


def test_snapshots_closer_than_their_measure_are_sized_by_their_threads_time(tmp_path):
    # a snapshot every 2 steps: the next one comes before AFTER steps have passed, so none is measured whole;
    # the threads' own time alone sizes the interval
    snaps = run(tmp_path, every=2, save_every=None, disturbed=False, steps=60)
    assert snaps._wall_cost_s is None
    assert snaps._cost_s is not None
    assert snaps.proposal() == max(1, math.ceil(snaps._cost_s / (0.01 * snaps._step_s)))
