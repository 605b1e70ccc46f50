"""The newest steps kept on the devices (jddp.checkpoint.snapshot_kept): the survivors of a failure write the newest
step the group completed as they are ended, and the restart recomputes no step, whatever the snapshot interval.

Generated over what a kept step can be when the flush comes (complete or still running, failed, older than a
snapshot), every point at which a kill can cut the flush's write, the settings and states that keep steps or not;
then under ``jddp launch`` with a process killed between snapshots, with one snapshot writer per host and with every
process writing its own.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import sys
import threading
import time

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jddp.checkpoint import snapshot, snapshot_format, snapshot_kept
from jddp.runtime import dispatch, flush
from tests.test_snapshot import CutOs, Killed, expected_bytes, tree_at


class Buffer:
    """A kept copy's buffer as ``write_kept`` sees it: complete or not, and holding an error or not."""

    def __init__(self, ready: bool, failed: bool = False) -> None:
        self.ready, self.failed = ready, failed

    def is_ready(self) -> bool:
        return self.ready

    def __array__(self, dtype=None, copy=None):
        if self.failed:
            raise RuntimeError("Gloo all-reduce failed: Connection reset by peer")  # as jax raises it
        return np.zeros(0, np.uint8)


def pending(step: int, *buffers) -> snapshot._Pending:
    layout = snapshot_format.shard_layout({})
    return snapshot._Pending(step, list(buffers), {"step": step}, layout)


@settings(max_examples=200, deadline=None)
@given(
    depth=st.integers(1, 4),
    state_bytes=st.integers(0, 1 << 40),
    limit=st.integers(1, 1 << 40),
    peak_share=st.floats(0, 1),
)
def test_kept_steps_fit_only_within_the_headroom_the_first_steps_left(depth, state_bytes, limit, peak_share):
    """On a device with memory figures: kept copies are wanted only when all of them fit in what the peak use left
    free (never past the limit: a feature for failures must not cause one), and always when they take at most
    ``HEADROOM_SHARE`` of it."""
    peak = int(limit * peak_share)
    memory = {"bytes_limit": limit, "peak_bytes_in_use": peak}
    need, free = depth * state_bytes, limit - peak
    fits = snapshot_kept.fits(depth, state_bytes, memory)
    if fits:
        assert need <= free
    if need <= snapshot_kept.HEADROOM_SHARE * free:
        assert fits


def test_on_cpu_kept_steps_fit_within_a_share_of_the_host_memory_and_never_without_its_figure():
    assert snapshot_kept.fits(3, 100, None, available_host=4 * 300)
    assert not snapshot_kept.fits(3, 101, None, available_host=4 * 300)
    assert not snapshot_kept.fits(3, 1, None, available_host=None)
    assert not snapshot_kept.fits(3, 1, {}, available_host=None)


@pytest.mark.parametrize(
    ("setting", "processes", "split"), list(itertools.product(("auto", "on", "off"), (1, 2, 4), (False, True)))
)
def test_steps_are_kept_in_a_group_for_a_whole_state_unless_turned_off(monkeypatch, setting, processes, split):
    """Every setting, group size and layout: kept (``max_inflight + 1`` deep) only in a group of processes, for a
    state of whole leaves (a survivor's copy is every process's), and not when turned off."""
    monkeypatch.setenv("JDDP_KEEP_STEPS", setting)
    kept = snapshot_kept.Kept(processes)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    spec = jax.sharding.PartitionSpec("data") if split else jax.sharding.PartitionSpec()
    leaf = jax.device_put(np.zeros(8, np.float32), jax.sharding.NamedSharding(mesh, spec))
    kept.fit(snapshot_format.shard_layout({"x": leaf}), [leaf])
    wanted = setting != "off" and processes > 1 and not split
    assert kept.depth == (dispatch.DISPATCHER.ahead + 1 if wanted else 0)


@pytest.mark.parametrize(("free", "kept"), [(40 << 30, True), (6 << 20, True), (5 << 20, False), (0, False)])
def test_on_an_accelerator_auto_keeps_steps_only_within_its_memory_headroom(monkeypatch, free, kept):
    """A faked GPU's memory figures (CPU devices have none): an 80 GiB device keeps 3 copies of a 1 MB state when
    its peak use left at least twice their 3 MB free, and not otherwise, however much host memory there is."""
    monkeypatch.setenv("JDDP_KEEP_STEPS", "auto")
    monkeypatch.setattr(dispatch.DISPATCHER, "ahead", 2)  # 3 copies
    limit = 80 << 30
    gpu = {"bytes_limit": limit, "peak_bytes_in_use": limit - free, "bytes_in_use": 1 << 30}
    monkeypatch.setattr(snapshot_kept, "_memory", lambda leaves: gpu)
    monkeypatch.setattr(snapshot_kept, "_available_host", lambda: 1 << 50)
    state = {"w": jax.device_put(np.zeros(1 << 18, np.float32), jax.devices()[0])}  # 1 MiB
    keeping = snapshot_kept.Kept(2)
    keeping.fit(snapshot_format.shard_layout(state), jax.tree.leaves(state))
    assert (keeping.depth > 0) is kept


@pytest.mark.parametrize("newer_than", [-1, 9, 10, 11, 12])
@pytest.mark.parametrize("ready", list(itertools.product((False, True), repeat=3)))
def test_the_kept_steps_a_flush_may_write_are_the_complete_ones_newer_than_the_snapshots(ready, newer_than):
    """Steps 10 to 12 kept, each complete or still running: the candidates are the complete ones newer than the
    newest snapshot, newest first; a step kept beyond ``depth`` is dropped."""
    kept = snapshot_kept.Kept(2)
    kept.depth = 3
    for step in (9, 10, 11, 12):
        kept.add(pending(step, Buffer(step == 9 or ready[step - 10])))
    got = [p.step for p in kept.complete(newer_than)]
    assert got == [s for s in (12, 11, 10) if ready[s - 10] and s > newer_than]


def test_the_flush_waits_a_little_for_a_copy_still_running_and_no_longer_for_one_that_never_ends():
    """Step 12's copy completes 50 ms after the flush began (its step was complete, the copy not yet run): it is
    the one written. Step 12 never completes (its step hangs): the flush gives up after ``FLUSH_WAIT_S`` and takes
    step 11."""
    kept = snapshot_kept.Kept(2)
    kept.depth = 3
    late = Buffer(False)
    for step, buffer in ((10, Buffer(True)), (11, Buffer(True)), (12, late)):
        kept.add(pending(step, buffer))
    timer = threading.Timer(0.05, lambda: setattr(late, "ready", True))
    timer.start()
    assert [p.step for p in kept.complete(-1, wait_s=30)] == [12, 11, 10]
    timer.join()
    late.ready = False
    start = time.monotonic()
    assert [p.step for p in kept.complete(-1, wait_s=0.2)] == [11, 10]
    assert time.monotonic() - start >= 0.2


def test_a_kept_step_outlives_the_donation_of_its_buffers_and_the_flush_writes_the_newest_bitwise(
    tmp_path, monkeypatch
):
    """Steps that donate the state: every step's copy is kept (none written between snapshots), and the flush
    writes the newest complete one, with its loader position and extra state, loaded back bitwise; a second flush
    writes nothing (no newer step), nor does one with the steps turned off."""
    monkeypatch.setenv("JDDP_KEEP_STEPS", "on")
    advance = jax.jit(lambda t: tree_at(t["d"] + 1), donate_argnums=0)
    snaps = snapshot.Snapshots(tmp_path / "memory", tmp_path / "ckpt", fingerprint=None, budget=0.01)
    snaps.kept.processes = 2  # as in a group: a process alone keeps none
    state = tree_at(0)
    for step in range(1, 8):
        state = advance(state)
        snaps.take(step, state, {"position": step}, {"step": step}, write=step == 2)
    jax.block_until_ready([state, *(p.buffers for p in snaps.kept._entries)])
    snaps.wait()
    assert snaps.steps() == [2]
    assert snaps.write_kept() == 7
    assert snaps.steps() == [7, 2]
    tree, loader, extra = snaps.load(7, tree_at(0), None)
    assert [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)] == expected_bytes(7)
    assert (loader, extra) == ({"position": 7}, {"step": 7})
    assert snaps.write_kept() is None
    snaps.close(remove=True)

    monkeypatch.setenv("JDDP_KEEP_STEPS", "off")
    off = snapshot.Snapshots(tmp_path / "off", tmp_path / "ckpt", fingerprint=None, budget=0.01)
    off.kept.processes = 2
    state = tree_at(0)
    for step in range(1, 4):
        state = advance(state)
        off.take(step, state, None, None, write=False)
    assert not off.keeps and off.write_kept() is None and off.steps() == []
    off.close(remove=True)


@pytest.mark.parametrize("failed", [1, 2, 3])
def test_the_flush_skips_the_copies_of_steps_that_failed_and_writes_the_newest_sound_one(tmp_path, monkeypatch, failed):
    """The newest ``failed`` kept steps failed (their collective's peer died: complete, holding the error): the
    flush writes the newest one before them, or nothing when none is left."""
    monkeypatch.setenv("JDDP_KEEP_STEPS", "on")
    snaps = snapshot.Snapshots(tmp_path / "memory", tmp_path / "ckpt", fingerprint=None, budget=0.01)
    snaps.kept.processes = 2
    snaps.take(1, tree_at(1), None, None, write=False)
    snaps.take(2, tree_at(2), None, None, write=False)
    good = list(snaps.kept._entries)
    jax.block_until_ready([p.buffers for p in good])  # complete
    snaps.kept.depth = 3
    snaps.kept._entries = [*good, pending(3, Buffer(True, failed=True))]
    if failed >= 2:
        snaps.kept._entries[1] = pending(2, Buffer(True, failed=True))
    if failed >= 3:
        snaps.kept._entries[0] = pending(1, Buffer(True, failed=True))
    want = {1: 2, 2: 1, 3: None}[failed]
    assert snaps.write_kept() == want
    assert snaps.steps() == ([] if want is None else [want])
    if want is not None:
        tree, _, _ = snaps.load(want, tree_at(0), None)
        assert [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)] == expected_bytes(want)
    snaps.close(remove=True)


def test_a_kill_at_any_point_of_the_flushs_write_leaves_the_complete_snapshots_and_no_torn_one(tmp_path, monkeypatch):
    """Every file-system call of the flush's write (a pwrite cut halfway too) is where the process dies (the
    launcher's SIGKILL after its grace): a process started afterwards lists only complete snapshots, each holding its
    own step's bytes, and no partial file."""
    monkeypatch.setenv("JDDP_KEEP_STEPS", "on")

    def kept_at(base):
        snaps = snapshot.Snapshots(base, tmp_path / "ckpt", fingerprint=None, budget=0.01)
        snaps.kept.processes = 2
        for step in (1, 2, 3):
            snaps.take(step, tree_at(step), {"position": step}, None, write=step == 1)
        snaps.wait()
        jax.block_until_ready([p.buffers for p in snaps.kept._entries])  # complete
        return snaps

    counting = CutOs(None)
    snaps = kept_at(tmp_path / "count")
    monkeypatch.setattr(snapshot, "os", counting)
    assert snaps.write_kept() == 3
    monkeypatch.undo()
    monkeypatch.setenv("JDDP_KEEP_STEPS", "on")
    assert counting.calls >= 5, counting.calls  # open, ftruncate, pwrite x2, close, replace
    for cut, half in itertools.product(range(counting.calls), (False, True)):
        base = tmp_path / f"cut-{cut}-{half}"
        snaps = kept_at(base)
        monkeypatch.setattr(snapshot, "os", CutOs(cut, half))
        with contextlib.suppress(Killed):  # a cut at close: the kernel closes a killed process's files
            snaps.write_kept()
        monkeypatch.undo()
        monkeypatch.setenv("JDDP_KEEP_STEPS", "on")
        snaps.close(remove=False)
        again = snapshot.Snapshots(base, tmp_path / "ckpt", fingerprint=None, budget=0.01)
        assert again.steps() in ([1], [3, 1]), (cut, half, again.steps())
        for step in again.steps():
            tree, loader, _ = again.load(step, tree_at(0), None)
            assert [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)] == expected_bytes(step), (cut, half)
            assert loader == {"position": step}
        assert not (again.folder / snapshot.FLUSHING).exists()
        again.close(remove=True)


def test_the_flush_runs_jddps_writes_after_the_users_flushes_and_the_streams(monkeypatch):
    """A user's registered flush and the streams come first (lines are quick, a state's write is not); a write
    forgotten (a closed Checkpointer's) does not run; one that raises stops nothing after it."""
    calls: list[str] = []
    monkeypatch.setattr(flush, "_registered", [])
    monkeypatch.setattr(flush, "_last", [])
    monkeypatch.setattr(sys, "stdout", type("Out", (), {"flush": lambda self: calls.append("stdout")})())
    flush.register_flush(lambda: calls.append("user"))

    def failing():
        calls.append("failing")
        raise OSError("full")

    def forgotten():
        calls.append("forgotten")

    flush.at_flush(failing)
    flush.at_flush(forgotten)
    flush.at_flush(lambda: calls.append("kept"))
    flush.forget(forgotten)
    flush.flush_all()
    assert calls == ["user", "stdout", "failing", "kept"]


@pytest.mark.parametrize("ready", list(itertools.product((False, True), repeat=3)))
def test_the_steps_not_known_complete_are_counted_from_the_oldest_still_running(ready):
    """Three calls pending, each complete or not: those from the oldest one not complete on are unfinished (the
    goodput ledger's step is the newest before them)."""
    dispatcher = dispatch.Dispatcher()
    for r in ready:
        dispatcher.after({"loss": Buffer(r)})
    first = next((i for i, r in enumerate(ready) if not r), len(ready))
    assert dispatcher.unfinished() == len(ready) - first


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory):
    """An uninterrupted 2-process run of the checkpointing worker (``tests.test_checkpoint``'s)."""
    from tests import test_checkpoint

    return test_checkpoint.reference_run(tmp_path_factory)


SAID = re.compile(r"^\[0\] RESUMED at step (\d+) attempt (\d) from (\w+)$", re.MULTILINE)


@pytest.mark.multiprocess
@pytest.mark.parametrize("writers", ["one per host", "every process"])
def test_a_process_killed_between_snapshots_is_resumed_at_its_last_step_from_a_survivors_kept_step(
    tmp_path, two_process_reference, writers
):
    """``jddp launch -n 2``: process 1 SIGKILLs itself after step 9; snapshots come every 1000 steps (one per host:
    none before the kill) or every 4 (every process writing its own: step 8 on both). The survivor writes step 9
    as it is ended, the restart restores it from that peer (not step 8, from disk or from every process's memory),
    and the run ends bitwise equal to the uninterrupted one."""
    from tests.test_checkpoint import assert_same_run, launch_killed_once_when

    env = {"SNAPSHOT_EVERY": "1000"} if writers == "one per host" else {"SNAPSHOT_EVERY": "4"}
    if writers == "every process":
        env["SNAPSHOTS_EVERY_PROCESS"] = "1"
    code, out, said = launch_killed_once_when(tmp_path, lambda line: True, env=env)
    shown = out + said
    assert code == 0, shown
    resumed = SAID.findall(out)
    assert resumed[0] == ("0", "0", "None") and len(resumed) == 2, shown
    assert resumed[1] == ("9", "1", "peer"), shown
    assert_same_run(tmp_path / "run", two_process_reference, f"kept step, {writers}")
