"""Elastic rounds with standby (``--nnodes 1:2`` on loopback): node 0's next processes stand by for the round it
would run alone, joined, built and compiled, so that losing the other node resumes from them, restored from memory;
and a round that is not the one prepared for does not wake them."""

from __future__ import annotations

import json
import signal
import time

import pytest

from jddp import net
from jddp.cli.launch import spares
from tests.test_elastic import Launcher, assert_restored_from_memory, assert_same_run, steps_taken, until

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
WOKEN = "woken from standby"


def test_node_0_alone_after_a_loss_resumes_from_its_standby_processes(tmp_path, alone):
    """a and b run round 0 of ``--nnodes 1:2``; once a's standby process for round 1 alone stands by (compiled), b's
    launcher is SIGKILLed: round 1 runs on a alone from the woken standby process, restored from round 0's snapshot in
    memory, and the run is the run of one process that never lost a node."""
    port, out = net.free_port(), tmp_path / "run"
    out.mkdir()
    a = Launcher(tmp_path, "a", port, out, 60, 0.15, nnodes="1:2")
    launchers = [a]
    until(lambda: net.answers("127.0.0.1", port + 1), 60, launchers)
    b = Launcher(tmp_path, "b", port, out, 60, 0.15, nnodes="1:2")
    launchers.append(b)
    try:
        until(lambda: spares.STANDBY_READY in a.text(), 240, launchers)
        assert any(s >= 1 for _, s in steps_taken(out, 1)), a.text()[-3000:]  # b's process trains in round 0
        b.popen.send_signal(signal.SIGKILL)
        lost_at = time.monotonic()
        b.popen.wait(10)
        resumed_at = until(lambda: any(r == 1 for r, _ in steps_taken(out, 0)), 120, launchers)
        code = a.wait(240)
    finally:
        for launcher in launchers:
            if launcher.popen.poll() is None:
                launcher.popen.kill()
    said = a.text()
    assert code == 0, said[-4000:]
    assert "round 1: 1 node(s), 1 process(es) (a node lost)" in said, said[-4000:]
    assert "process(es) 0 (pid" in said and WOKEN in said.split("round 1: 1 node(s)")[1], said[-4000:]
    assert_same_run(out, alone)
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    rounds = [(r["round"], r["nodes"], r["processes"]) for r in records if r.get("split") == "goodput"]
    assert rounds == [(0, 2, 2), (1, 1, 1)], rounds
    assert_restored_from_memory(records)
    print(f"from the loss to training again, from standby: {resumed_at - lost_at:.1f} s")


def test_a_round_other_than_the_one_prepared_for_starts_its_processes_anew(tmp_path, alone):
    """a and b run round 0 of ``--nnodes 1:2``, a's standby process prepared for round 1 alone; b's process fails
    (SIGKILL after step 40, a restart left) and b's launcher stays: round 1 is two nodes again, which the standby
    process was not built for (one process of one device). It is ended, not woken, saying so; round 1's processes
    start anew, and the run is still the run of one process."""
    port, out = net.free_port(), tmp_path / "run"
    out.mkdir()
    restarts = ("--max-restarts", "1")
    a = Launcher(tmp_path, "a", port, out, 60, "0.5,0.15", nnodes="1:2", flags=restarts)
    launchers = [a]
    until(lambda: net.answers("127.0.0.1", port + 1), 60, launchers)
    b = Launcher(tmp_path, "b", port, out, 60, "0.5,0.15", nnodes="1:2", flags=restarts, KILL_AT="40,-1")
    launchers.append(b)
    try:
        until(lambda: spares.STANDBY_READY in a.text(), 240, launchers)
        codes = [launcher.wait(300) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.popen.poll() is None:
                launcher.popen.kill()
    said = a.text()
    assert codes == [0, 0], said[-4000:]
    assert "round 1: 2 node(s), 2 process(es)" in said, said[-4000:]
    assert said.index(spares.STANDBY_READY) < said.index("round 1:"), said[-4000:]  # ready before the failure
    assert WOKEN not in said and "were prepared for 1 node(s), 1 process(es), not this round's" in said, said[-4000:]
    assert_same_run(out, alone)
