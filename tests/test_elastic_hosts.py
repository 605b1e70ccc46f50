"""Elastic membership across three hosts of the network-namespace bed (``tests/netns_bed.py``): each host its own
address, one launcher per host with ``--nnodes 2:3``. Host c is lost whole (every process inside it SIGKILLed, its
launcher too); the run goes on with two and finishes there. The losses and final parameters equal those of one
process that trained alone, never interrupted (``tests/test_elastic.py``), to float round-off: the run is the one
that never lost a host.

``RETURNS=1`` runs the same with host c coming back as a new launcher, admitted mid-run. The suite runs that case
under SLURM instead (``tests/test_slurm_hosts.py``: the same bed, with a slurmd in each host, the lost host's
return a new job on its node), and on loopback (``tests/test_elastic.py``); ``JDDP_TEST_RETURNS=1`` runs it here too
(a machine without SLURM).
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tests import netns_bed
from tests.test_elastic import BATCHES, FIT_TRAIN, assert_restored_from_memory, assert_same_run, steps_taken

pytestmark = [pytest.mark.multiprocess, netns_bed.SKIP]

BODY = r"""
out=$1; shift
common=(-n 1 --devices-per-process 1 --nnodes 2:3 --coordinator "$ADDR_A:29500" --peer-timeout 10 --join-wait 5
        --kill-grace 1 "$@")
launcher a host0 "${common[@]}"
wait_for host0 "hosts the rendezvous" 60 || exit 1
launcher b host1 "${common[@]}"
launcher c host2 "${common[@]}"
until_ 240 step_at_least 0 8 "$out/steps0.txt" || exit 1
grep -q "round 0: 3 node(s)" "$logs/host0.log" || { echo "round 0 did not have 3 nodes" >&2; exit 1; }
kill_host c
date +%s.%N > "$out/lost_at"
until_ 120 step_at_least 1 0 "$out/steps0.txt" || exit 1
date +%s.%N > "$out/training_again_at"
if [ "$RETURNS" = 1 ]; then
  launcher c host2-back "${common[@]}"
  reap host0 host1 host2-back
else
  reap host0 host1
fi
"""


@pytest.mark.parametrize(
    "returns",
    [
        False,
        pytest.param(True, marks=pytest.mark.skipif(
            os.environ.get("JDDP_TEST_RETURNS") != "1",
            reason="run under SLURM in tests/test_slurm_hosts.py; JDDP_TEST_RETURNS=1 runs it here",
        )),
    ],
    ids=["finishes-on-two", "host-returns"],
)  # fmt: skip
def test_three_hosts_lose_one_and_train_the_run_that_never_lost_it(tmp_path, alone, returns):
    """Host c lost whole at step 8 or later; the run finishes on the two left, or host c comes back as a new launcher
    and is admitted at a step every process agrees on (its checkpoint saved), the run finishing on three."""
    out = tmp_path / "run"
    out.mkdir()
    env = {"STEP_SLEEP": "0.15", "RETURNS": str(int(returns)), **BATCHES}
    logs = netns_bed.run(tmp_path, BODY, str(out), FIT_TRAIN, str(out), "60", hosts=3, timeout=600, env=env)
    said = logs["host0"]
    assert "round 1: 2 node(s), 2 process(es) (a node lost)" in said, said[-4000:]
    rounds_run = [0, 1, 2] if returns else [0, 1]
    assert ("round 2: 3 node(s), 3 process(es) (admitting a node)" in said) == returns, said[-4000:]
    # Host c's processes took no step in round 1 (two hosts); which process id it had depends on the join order.
    assert sorted({r for rank in (0, 1, 2) for r, _ in steps_taken(out, rank)}) == rounds_run
    assert sum(1 for rank in (0, 1, 2) if any(r == 1 for r, _ in steps_taken(out, rank))) == 2
    assert max(s for r, s in steps_taken(out, 0) if r == rounds_run[-1]) == 60  # finished in the last round
    assert_same_run(out, alone)
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    rounds = [(r["round"], r["nodes"], r["processes"]) for r in records if r.get("split") == "goodput"]
    assert rounds == [(0, 3, 3), (1, 2, 2), (2, 3, 3)][: len(rounds_run)], rounds
    assert_restored_from_memory(records)
    lost = float((out / "lost_at").read_text())
    again = float((out / "training_again_at").read_text())
    print(f"three hosts: from the loss of host c to training again on two: {again - lost:.1f} s")


NODE0_BODY = r"""
out=$1; shift
common=(-n 1 --devices-per-process 1 --nnodes 2:3 --coordinator "$ADDR_A:29500" --peer-timeout 10 --join-wait 5
        --kill-grace 1 "$@")
launcher a host0 "${common[@]}"
wait_for host0 "hosts the rendezvous" 60 || exit 1
launcher b host1 "${common[@]}"
launcher c host2 "${common[@]}"
until_ 240 step_at_least 0 8 "$out/steps0.txt" || exit 1
grep -q "round 0: 3 node(s)" "$logs/host0.log" || { echo "round 0 did not have 3 nodes" >&2; exit 1; }
if [ "$HOW" = unplug ]; then unplug a; else kill_host a; fi
date +%s.%N > "$out/lost_at"
until_ 120 step_at_least 1 0 "$out/steps0.txt" || exit 1
date +%s.%N > "$out/training_again_at"
reap host1 host2 || exit 1
if [ "$HOW" = unplug ]; then
  reap host0  # cut off, it finds its two members silent and ends below MIN, naming them
  [ "${code[host0]}" = 69 ] || { echo "host0 exited ${code[host0]}, not 69" >&2; exit 1; }
fi
exit 0
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "unplug"])
def test_three_hosts_lose_node_0_and_the_next_candidate_hosts_the_run(tmp_path, alone, how):
    """Host a (node 0: the rendezvous and the coordination service) lost at step 8 or later, killed whole or cut off
    (its cable pulled: silent for the peer timeout): the first coordinator candidate, on its own address (the one
    towards a's), hosts round 1's rendezvous and service, the other joins it there, and the run finishes on two, the
    run that never lost a host. Cut off, host a's launcher ends below MIN (69)."""
    out = tmp_path / "run"
    out.mkdir()
    env = {"STEP_SLEEP": "0.15", "HOW": how, **BATCHES}
    logs = netns_bed.run(tmp_path, NODE0_BODY, str(out), FIT_TRAIN, str(out), "60", hosts=3, timeout=600, env=env)
    hosts = [name for name in ("host1", "host2") if "this launcher is node 0 from round 1 on" in logs[name]]
    assert len(hosts) == 1, logs
    said = logs[hosts[0]]
    assert "round 1: 2 node(s), 2 process(es) (node 0 lost)" in said, said[-4000:]
    assert re.search(r"hosts the rendezvous at 10\.231\.0\.[23]:\d+ port \+ 1", said), said[-4000:]
    assert max(s for r, s in steps_taken(out, 0) if r == 1) == 60  # finished in round 1
    assert_same_run(out, alone)
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    rounds = [(r["round"], r["nodes"], r["processes"]) for r in records if r.get("split") == "goodput"]
    assert rounds == [(0, 3, 3), (1, 2, 2)], rounds
    assert_restored_from_memory(records)
    lost = float((out / "lost_at").read_text())
    again = float((out / "training_again_at").read_text())
    print(f"three hosts: from the loss of node 0 (host a, {how}) to training again on two: {again - lost:.1f} s")
