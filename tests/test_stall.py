"""The stall detector (jddp.runtime.progress and the watchdog): a group that is alive but stuck ends, naming the
process that is behind and where, with a flight record from every process; a group that is only slow does not."""

from __future__ import annotations

import re
import threading
import time

import pytest

from jddp import exitcodes
from jddp.runtime import flight, progress, watchdog
from tests import multiprocess

STALL = str(multiprocess.WORKERS / "stall.py")
PEER_TIMEOUT = 10.0  # the watchdog's round is a tenth of it, at most 1 s (watchdog.MAX_ROUND_S)
VERDICT = re.compile(r"no process made progress for ([\d.]+) s \(bound ([\d.]+) s")


def launch_stall(tmp_path, how: str, floor: float, *extra: str, steps: int = 100, peer_timeout: float = PEER_TIMEOUT):
    env = {"STALL": how, "STALL_AT": "20", "STALL_RANK": "1", "JDDP_STALL_FLOOR": str(floor)}
    if how != "data":
        env["JDDP_FLIGHT_DIR"] = str(tmp_path / "flight")
    return multiprocess.launch(
        "-n", "2", "--peer-timeout", str(peer_timeout), *extra, STALL, str(tmp_path), str(steps), env=env
    )


def check_stall(done, flight_dir, frame: str, peer_timeout: float = PEER_TIMEOUT) -> None:
    """Both processes end with 70 and a line naming process 1 at ``frame``; both wrote a flight record."""
    assert done.returncode == exitcodes.EXIT_STALLED, done.stdout[-3000:] + done.stderr[-5000:]
    for p in (0, 1):
        line = next(x for x in done.stderr.splitlines() if x.startswith(f"[{p}] jddp: process {p} of 2 stopped"))
        assert "Behind: process 1 (step 20," in line, line
        assert "stall.py:" in line and frame in line.split("Behind:")[1].split("This process")[0], line
        quiet, bound = map(float, VERDICT.search(line).groups())
        # Judged within the learned bound: the group was quiet longer than the bound, by less than the watchdog's
        # rounds (one to see the last tick, one to judge; at most 1 s each whatever the peer timeout) and what a
        # loaded machine adds to them. Rounds of T / 10 made it bound + 6 to 9 s at T = 30 s.
        assert bound <= quiet <= bound + 3 * min(peer_timeout / 10, watchdog.MAX_ROUND_S) + 2, line
        assert f"exiting with code {exitcodes.EXIT_STALLED}" in line
    assert "the group stalled: each process's last line above names the process that was behind" in done.stderr
    records = {p: (flight_dir / flight.FLIGHT_FILE.format(p)).read_text() for p in (0, 1)}
    assert "step 20 (steps dispatched)" in records[1]
    assert f"in {frame}" in records[1]  # the stalled frame, in the Python stacks of process 1
    assert "process 1: step 20," in records[0]  # process 0 saw process 1 behind at step 20
    assert re.search(r"in flight \(dispatched, not yet waited for\): train step \d+", records[0]), records[0]
    assert re.search(r"the last: train step \d+", records[0])


@pytest.mark.multiprocess
def test_a_process_sleeping_in_its_data_loading_stalls_the_group_named_with_flight_records(tmp_path):
    done = launch_stall(tmp_path, "data", 3)
    check_stall(done, tmp_path / "log", "slow_transform")
    assert "phase data" in done.stderr.split("Behind:")[1].splitlines()[0]


@pytest.mark.multiprocess
def test_a_python_loop_of_the_script_in_a_hand_written_loop_stalls_the_group_named(tmp_path):
    done = launch_stall(tmp_path, "spin", 3, peer_timeout=30)  # the default timeout: rounds still 1 s apart
    ended = time.time()
    check_stall(done, tmp_path / "flight", "spin_forever", peer_timeout=30)
    # From the stall to the launcher's exit: the learned bound and a few rounds of 1 s, not of T / 10 (which took
    # bound + 9 to 11 s at T = 30 s); the margin is for a loaded machine.
    stalled = float(re.search(r"STALLING 20 ([\d.]+)", done.stdout).group(1))
    bound = float(VERDICT.search(done.stderr).group(2))
    assert ended - stalled <= bound + 3 + 3, (ended - stalled, bound)


@pytest.mark.multiprocess
def test_a_pause_of_every_process_in_code_of_its_own_and_a_slow_run_are_no_stall(tmp_path):
    """Every process sleeps 8 s at step 20, well past the 3 s floor, but nobody waits for anybody: no stall. The
    run also passes the floor's 3 s on a loaded machine without a false alarm over its 100 steps."""
    done = launch_stall(tmp_path, "pause", 3)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert sorted(x for x in done.stdout.splitlines() if "DONE" in x) == ["[0] DONE 0 100", "[1] DONE 1 100"]
    assert not (tmp_path / "flight").exists()


# ------------------------------------------------------------------------------------------------ unit tests


@pytest.fixture
def fresh(monkeypatch):
    p = progress.Progress()
    monkeypatch.setattr(progress, "PROGRESS", p)
    return p


def test_the_bound_is_the_factor_times_the_slowest_interval_clamped(fresh, monkeypatch):
    fresh.settings = progress.Settings(factor=10, floor_s=2, ceiling_s=50)
    assert fresh.bound() == 50  # nothing learned yet: the ceiling
    fresh.intervals.extend([0.01, 0.5, 0.02])
    assert fresh.bound() == pytest.approx(5.0)
    fresh.intervals.append(9.0)
    assert fresh.bound() == 50
    fresh.intervals.clear()
    fresh.intervals.extend([0.01, 0.05])
    assert fresh.bound() == 2


def test_ticks_learn_only_in_learned_phases_and_count_steps(fresh, monkeypatch):
    clock = iter([10.0, 10.5, 11.0, 20.0, 20.1, 20.3, 20.4, 20.6])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    progress.heartbeat(1)  # 10.0: the first tick, no interval yet (phase setup)
    assert (fresh.step, fresh.ticks, list(fresh.intervals)) == (1, 1, [])
    with progress.phase("step"):  # since 10.5
        progress.heartbeat(2)  # 11.0: 1 s after the last tick, in a learned phase
    # leaving the phase at 20.0: setup is over once a step ticked, so the script's own time follows
    assert fresh.phase == "user" and list(fresh.intervals) == [1.0]
    with progress.phase("checkpoint"):  # 20.1
        progress.heartbeat()  # 20.3: not learned (a checkpoint may take any time)
    assert list(fresh.intervals) == [1.0] and fresh.step == 2 and fresh.ticks == 3
    assert fresh.phase == "user"
    progress.set_step(7)
    assert fresh.step == 7 and fresh.ticks == 3


def test_phases_nest_and_restore(fresh):
    fresh.tick()
    with progress.phase("eval"):
        with progress.phase("compile"):
            assert fresh.phase == "compile"
        assert fresh.phase == "eval"
    assert fresh.phase == "user"
    fresh2 = progress.Progress()
    assert fresh2.phase == "setup"


def test_published_progress_reads_back(fresh):
    fresh.settings = progress.Settings(factor=10, floor_s=1, ceiling_s=99)
    fresh.step, fresh.ticks = 42, 40
    fresh.intervals.extend([0.2, 0.3])
    with progress.phase("da;ta"):
        seen = progress.Seen.parse(progress.publish(7, waiting=True))
    assert seen is not None
    assert (seen.step, seen.ticks, seen.waiting, seen.bound, seen.phase) == (42, 40, True, 3.0, "da,ta")
    assert not seen.learned  # a phase of the user's own: the ceiling applies
    with progress.phase("data"):
        assert progress.Seen.parse(progress.publish(8, waiting=False)).learned
    for value in (None, "done", "failed", "lost", "stalled", "12", "1;2;x;0;1;1;p;0"):
        assert progress.Seen.parse(value) is None


def seen(step, *, waiting=False, bound=5.0, learned=True, phase="step"):
    return progress.Seen(step, 0, waiting, bound, learned, phase, 0.0)


def test_the_group_bound_is_the_largest_learned_or_the_ceiling():
    assert progress.group_bound({0: seen(1, bound=4), 1: seen(1, bound=7)}, 100) == 7
    assert progress.group_bound({0: seen(1, bound=4), 1: seen(1, learned=False)}, 100) == 100


def test_behind_is_the_lowest_step_and_not_waiting():
    assert progress.behind({0: seen(22, waiting=True), 1: seen(20), 2: seen(21, waiting=True)}) == [1]
    assert progress.behind({0: seen(20, waiting=True), 1: seen(20), 2: seen(20, waiting=True)}) == [1]
    assert progress.behind({0: seen(20, waiting=True), 1: seen(20, waiting=True)}) == [0, 1]
    assert progress.behind({0: seen(5), 1: seen(5)}) == [0, 1]


def test_the_stalled_frame_is_the_scripts_innermost_frame_closest_to_the_leaf():
    release = threading.Event()

    def stuck_in_a_transform():
        while not release.is_set():
            time.sleep(0.01)  # the leaf: a C call, no library frame under this one

    reader = threading.Thread(target=stuck_in_a_transform, name="reader")
    reader.start()
    box = []
    # As in a process, a thread of jddp's own (left out of the search) looks; the main thread meanwhile waits in
    # join, two of threading's frames under this test's own.
    looker = threading.Thread(target=lambda: (time.sleep(0.05), box.append(flight.stalled_frame())), name="jddp-x")
    looker.start()
    looker.join()
    release.set()
    reader.join()
    assert "in stuck_in_a_transform (thread reader)" in box[0], box[0]
    assert "test_stall.py:" in box[0]


def test_settings_from_the_environment_are_checked(monkeypatch):
    monkeypatch.setenv("JDDP_STALL_FLOOR", "5")
    monkeypatch.setenv("JDDP_STALL_CEILING", "50")
    monkeypatch.setenv("JDDP_STALL_FACTOR", "4")
    monkeypatch.setenv("JDDP_STALL", "0")
    s = progress.Settings.from_env()
    assert (s.floor_s, s.ceiling_s, s.factor, s.enabled) == (5, 50, 4, False)
    monkeypatch.setenv("JDDP_STALL_FLOOR", "soon")
    with pytest.raises(ValueError, match=r"\$JDDP_STALL_FLOOR='soon' must be a number of seconds"):
        progress.Settings.from_env()
    monkeypatch.setenv("JDDP_STALL_FLOOR", "-1")
    with pytest.raises(ValueError, match="must be positive"):
        progress.Settings.from_env()
    monkeypatch.setenv("JDDP_STALL_FLOOR", "60")
    with pytest.raises(ValueError, match=r"floor \(60 s\) is above its ceiling \(50 s\)"):
        progress.Settings.from_env()


def test_configure_checks_before_changing_anything(fresh):
    before = fresh.settings
    with pytest.raises(ValueError, match=r"`factor=0\.0` must be positive"):
        progress.configure(factor=0)
    with pytest.raises(ValueError, match="above its ceiling"):
        progress.configure(floor_s=10, ceiling_s=5)
    assert fresh.settings is before
    s = progress.configure(floor_s=1, flight_dir="x")
    assert (s.floor_s, s.flight_dir, s.ceiling_s) == (1, "x", before.ceiling_s)


def test_the_flight_record_holds_progress_the_group_and_every_threads_stack(fresh, tmp_path, monkeypatch):
    import collections

    from jddp.runtime import dispatch

    fresh.settings = progress.Settings(flight_dir=str(tmp_path))
    fresh.step, fresh.ticks, fresh.programs, fresh.last_done = 20, 20, 18, "train step 17"
    pending = collections.deque([(None, "train step 18"), (None, "train step 19")])
    monkeypatch.setattr(dispatch.DISPATCHER, "_pending", pending)
    path = flight.write_flight_record(3, "a test", {3: seen(20), 4: seen(22, waiting=True)})
    assert path == tmp_path / "flight-process-3.txt"
    text = path.read_text()
    assert "jddp flight record: process 3" in text and "reason: a test" in text
    assert "step 20 (steps dispatched)" in text
    assert "the last: train step 17" in text and "train step 18, train step 19" in text
    assert "process 4: step 22, waiting for its peers" in text
    assert "--- thread MainThread (main)" in text
    assert "in test_the_flight_record_holds_progress_the_group_and_every_threads_stack" in text


# ------------------------------------------------------------ collective calls (progress.collective_call)


def calls(seq: int, *names: str, inside: bool = True) -> progress.Calls:
    parsed = progress.Calls.parse(f"{seq}:{int(inside)}:{','.join(names)}")
    assert parsed is not None
    return parsed


def test_a_call_made_by_one_process_is_named_with_the_process_and_the_others_call():
    step, save = "DataParallel.step", "Checkpointer.save"
    # Process 0 made a save where process 1 made its next step: the save breaks process 0's routine, so it is the
    # one made alone, also with two processes, whichever order they are listed in.
    for first, second in ((0, 1), (1, 0)):
        found = progress.mismatch({first: calls(6, step, step, save), second: calls(6, step, step, step)})
        assert found is not None and found.seq == 6 and found.culprits() == (first,)
        text = found.describe()
        assert text.startswith(f"process {first} called {save} alone (jddp collective call #6); ")
        assert f"process {second} was in {step} (call #6 there)" in text
    # Three processes: the call of the fewest, whatever their routine; "without the others" for several.
    three = {0: calls(4, step, save), 1: calls(4, step, step), 2: calls(4, step, save)}
    found = progress.mismatch(three)
    assert found is not None and found.odd == step and found.culprits() == (1,)
    four = {p: calls(4, step, save if p < 2 else step) for p in range(5)}
    found = progress.mismatch(four)
    assert found is not None and found.culprits() == (0, 1)
    assert found.describe().startswith(f"processes [0, 1] called {save} without the others")


def test_processes_a_call_apart_with_the_same_calls_are_no_mismatch():
    step, save = "DataParallel.step", "Checkpointer.save"
    # Process 1 is ahead: its call #5 was process 0's current call too.
    assert progress.mismatch({0: calls(5, step, save), 1: calls(7, step, save, step, step)}) is None
    assert progress.mismatch({0: calls(5, step, save), 1: calls(7, step, step, step, step)}) is not None
    # Call #1 fell out of the window of the process ahead: nothing to compare, no verdict.
    far = calls(1 + progress.CALL_HISTORY, *[step] * progress.CALL_HISTORY)
    assert progress.mismatch({0: calls(1, save), 1: far}) is None
    assert progress.mismatch({0: calls(0), 1: calls(3, step, step, step)}) is None  # no call yet
    assert progress.mismatch({0: calls(3, step, step, save)}) is None  # alone


def test_collective_calls_count_the_outermost_call_once_and_publish_the_last_names():
    p = progress.PROGRESS
    before = p.call_seq
    outer, inner = progress.collective_call("test.outer"), progress.collective_call("test.inner", eager=False)
    try:
        with outer, inner:
            assert p.call_depth == 2 and progress.Calls.parse(progress.calls_text()).inside  # type: ignore[union-attr]
        inner(lambda: None)()
        seen = progress.Calls.parse(progress.calls_text())
        assert seen is not None and not seen.inside and seen.seq == before + 2
        assert seen.names[-2:] == ("test.outer", "test.inner") and seen.name_at(before + 1) == "test.outer"
        assert {"test.outer", "test.inner"} <= set(progress.COLLECTIVE_CALLS)
    finally:
        for name in ("test.outer", "test.inner"):
            progress.COLLECTIVE_CALLS.remove(name)
