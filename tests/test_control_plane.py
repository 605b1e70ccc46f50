"""The control-plane simulator (benchmarks/control_plane.py) itself: its counts, its failure detection, its slope."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import control_plane
from jddp.runtime import heartbeats, progress, watchdog


@pytest.fixture(scope="module")
def group():
    # 4 simulated processes in 2 in-process workers, the service in a process of its own; peer timeout 1 s;
    # this process's progress left as it is (at_step=0)
    g = control_plane.Group(4, 2, 1.0, inprocess=True, at_step=0)
    try:
        g.all("connect")
        yield g
    finally:
        g.close()


def test_counts_are_what_the_service_holds(group, monkeypatch):
    # heartbeat values of one length whatever the round (the real ones carry a phase age that may gain a digit)
    monkeypatch.setattr(progress, "publish", lambda counter, waiting: f"{counter % 10};0;0;0;1.000;0;step;0.5")
    n = group.n
    group.all("op", "heartbeat")  # every key exists: each read below finds all N, and the summary
    answers = group.all("op", "heartbeat")
    counts = control_plane.add_counts([a["counts"] for a in answers])
    # every process sets its heartbeat; the aggregator reads all N and sets its summary, the others read that
    assert counts["by_call"] == {"key_value_set": n + 1, "key_value_dir_get": 1, "key_value_try_get": n - 1}
    # The reference: the heartbeat keys and values as the service holds them, read by an uncounted client.
    stored = [(k, v.decode()) for k, v in group.one(0, "read", "jddp/alive/")["entries"]]
    assert sorted(int(k.rsplit("/", 1)[1]) for k, _ in stored) == list(range(n))
    one_pair = {k: len(k.encode()) + len(v.encode()) for k, v in stored}
    summary = len(watchdog.Summary(1, {}, [], None, False).text())  # a one-digit round, as here
    key = len(watchdog.SUMMARY_KEY)
    prefix = len(b"jddp/alive/")
    # sent: every pair and its flag, the aggregator's prefix and summary (and flag), the others' summary key;
    # received: every pair once (the aggregator's read), the summary by each of the others: O(N) a round
    sent = sum(one_pair.values()) + 8 * n + prefix + key + summary + 8 + (n - 1) * key
    assert counts["values"] == n + n - 1
    assert counts["sent"] + counts["received"] == sent + sum(one_pair.values()) + (n - 1) * summary
    answers = group.all("op", "heartbeat_all_read")  # the round before the aggregator: N^2 values
    counts = control_plane.add_counts([a["counts"] for a in answers])
    assert counts["by_call"] == {"key_value_set": n, "key_value_dir_get": n}
    assert counts["values"] == n * n
    expected = sum(one_pair.values()) + 8 * n + n * prefix + n * sum(one_pair.values())
    assert counts["sent"] + counts["received"] == expected
    # a barrier and a host all-gather announce themselves first (a key_value_set each): the calls a real process
    # makes (tests/test_control_plane_real.py counts them in one)
    answers = group.all("op", "barrier")
    assert control_plane.add_counts([a["counts"] for a in answers])["by_call"] == {
        "key_value_set": 2 * n,
        "wait_at_barrier": n,
    }
    group.all("op", "all_gather")
    answers = group.all("op", "all_gather")  # the second call deletes the first one's keys
    counts = control_plane.add_counts([a["counts"] for a in answers])
    assert counts["by_call"] == {
        "key_value_set": n,
        **dict.fromkeys(("key_value_set_bytes", "wait_at_barrier", "key_value_dir_get_bytes", "key_value_delete"), n),
    }
    assert counts["values"] == n * n
    assert group.one(0, "read", "jddp/host/1/")["entries"] == []  # deleted by every process
    gathered = group.one(1, "gathered")["values"]
    assert gathered == [control_plane.SMALL_VALUE] * n


def test_detection_names_the_stopped_process(group):
    # after the counts test (module order): the watchdogs start from the values the rounds above left
    # processes 0 and 1 run jddp's Watchdog; 2 and 3 make its calls without judging (LightRound); 3 stops
    found = control_plane.detect(group, 1.0, 0.5, observers=2)
    assert found["survivors"] == 2
    assert found["knew"] == 2
    # each names the stopped process (3) alone: the aggregator found it silent, the other read it in its summary
    assert found["named"] == 2, found["reasons"]
    assert all(re.match(r"lost process\(es\) \[3\]", r) for r in found["reasons"])
    interval = found["interval_s"]
    # jddp's rule: silent for more than the peer timeout, seen at a round (its last value was read at most a
    # round before the stop); the upper bound is the simulator's own deadline, not a timing claim
    assert found["all_s"] is not None and found["all_s"] >= 1.0 - interval
    assert found["rounds_per_s"] > 0


@pytest.mark.multiprocess  # starts a process of its own
def test_detection_names_the_aggregator_when_it_stops_after_a_restart():
    # process 0 reads every heartbeat and publishes the summary the others act on: when it stops, its summary
    # stops moving, and every other watchdog names it as it would any silent peer (a group of its own: the one
    # above keeps the marks of its stopped process)
    # (restarted first, as a whole group's control plane after a failure: every client leaves, a new service on a
    # new port, new clients join it; the detection below then runs on the new group alone: the old service ended)
    g = control_plane.Group(4, 2, 1.0, inprocess=True, at_step=0)
    try:
        g.all("connect")
        old_service, old_address = g.service, g.address
        restart = g.restart()
        assert old_service.poll() is not None and g.address != old_address
        assert restart["restart_s"] >= restart["service_start_s"] + restart["rejoin_s"] > 0
        found = control_plane.detect(g, 1.0, 0.5, victim=0)
    finally:
        g.close()
    assert found["survivors"] == 3 and found["knew"] == 3
    assert found["named"] == 3, found["reasons"]
    assert found["all_s"] is not None and found["all_s"] >= 1.0 - found["interval_s"]


@settings(max_examples=50, deadline=None)
@given(
    round_=st.integers(0, 2**40),
    states=st.dictionaries(st.integers(0, 4095), st.sampled_from(heartbeats.ENDED), max_size=8),
    silent=st.lists(st.integers(0, 4095), max_size=8),
    groups=st.one_of(
        st.none(),
        st.dictionaries(
            st.text(min_size=1, max_size=30), st.lists(st.integers(0, 4095), min_size=1, max_size=4), min_size=2
        ),
    ),
    seq=st.integers(1, 10**6),
    stalled=st.booleans(),
)
def test_a_summary_reads_back_as_it_was_written(round_, states, silent, groups, seq, stalled):
    mismatch = None if groups is None else progress.Mismatch(seq, {k: tuple(v) for k, v in groups.items()}, min(groups))
    summary = watchdog.Summary(round_, states, silent, mismatch, stalled)
    assert watchdog._parse_summary(summary.text()) == summary
    assert watchdog._parse_summary(None) is None


def test_the_summary_of_a_whole_group_ending_is_a_few_bytes():
    # every watchdog reads the summary every round: at the end of a run of 1024 processes every one is DONE, and
    # the summary must not list them one by one (1023 readers x N entries would be N^2 again)
    ended = watchdog.Summary(7, dict.fromkeys(range(1024), heartbeats.DONE), [], None, False)
    assert len(ended.text()) < 120, ended.text()
    assert watchdog._parse_summary(ended.text()) == ended


def test_mid_training_values_are_a_runs(monkeypatch):
    monkeypatch.setattr(progress, "PROGRESS", progress.Progress())  # this process's own is left alone
    control_plane.mid_training(100)
    value = watchdog._value(progress.publish(7, False))
    state, _, calls = value.partition("|")
    assert state.split(";")[:4] == ["7", "100", "100", "0"]  # counter, step, ticks, not waiting
    assert state.split(";")[6] == "user"  # between steps: the script's own code
    names = ["DataParallel.step", "Checkpointer.maybe_save"] * (progress.CALL_HISTORY // 2)
    assert calls == "200:0:" + ",".join(names)


def test_slope_against_numpy():
    rng = np.random.default_rng(0)
    ns = [2, 8, 32, 128, 512]
    costs = [float(c) for c in 3.0 * np.asarray(ns) ** 1.7 * rng.uniform(0.8, 1.25, len(ns))]
    reference = np.polyfit(np.log(ns), np.log(costs), 1)[0]
    assert math.isclose(control_plane.slope(ns, costs), reference, rel_tol=1e-9)
    assert math.isnan(control_plane.slope([8], [1.0]))


def test_bad_process_counts_are_refused():
    with pytest.raises(ValueError, match="--n='1,8'"):
        control_plane.parse_counts("1,8")
    with pytest.raises(ValueError, match="--n='2,x'"):
        control_plane.parse_counts("2,x")
    with pytest.raises(ValueError, match="num_processes"):
        control_plane.measure(1)
