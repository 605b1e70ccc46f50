"""jddp under a real SLURM over several hosts: the three hosts of the network-namespace bed (``tests/netns_bed.py``),
one ``slurmd`` in each (node1 to node3 at 10.231.0.1 to .3), ``slurmctld`` and ``munged`` beside node1's.

- ``srun -N 3`` runs ``fit_train.py`` as three processes on three hosts: ``jddp.initialize()`` finds the group
  from SLURM's variables (the coordinator at node1, the first node of the step), gloo connects the hosts by their
  own addresses, and the run equals one process that trained alone, to float round-off; gloo's chatter reaches no
  output.
- ``srun -N 3 --no-kill jddp launch --nnodes 2:3``: elastic membership under SLURM. Host c is lost whole (its
  slurmd, launcher and processes SIGKILLed); the launchers on a and b re-form the group and finish on two, SLURM
  keeping the step running on the nodes left (``--no-kill``). Then node3's slurmd is back, and a new job on it
  (``srun -w node3``, what a scheduler starts on a host that returns) is admitted by the running group, which
  finishes on three. Every loss equals the uninterrupted run's to float round-off.

The node names resolve to the hosts' addresses through a hosts file bind-mounted over ``/etc/hosts`` inside the
sandbox's own mount namespace (a real cluster has DNS for this), so nothing outside the sandbox changes. The daemons
run inside the sandbox's PID namespace: they end with it, even when the test is killed.
"""

from __future__ import annotations

import json
import re

import pytest

from tests import netns_bed
from tests.slurm_cluster import unavailable
from tests.test_elastic import BATCHES, FIT_TRAIN, assert_restored_from_memory, assert_same_run, steps_taken

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    netns_bed.SKIP,
    pytest.mark.skipif(bool(unavailable()), reason=str(unavailable())),
]

CHATTER = re.compile(r"\[Gloo\] Rank \d+ is connected to")  # gloo's line at each new set of devices

# The cluster: munged, slurmctld and three slurmd (node1 in host a, node2 in b, node3 in c), all ports inside the
# hosts' own network namespaces (fixed: nothing else listens there). ``slurm_up`` returns once sinfo shows the three
# nodes idle; ``sq CMD...`` runs a SLURM command from host a.
CLUSTER = r"""
root=$(mktemp -d /tmp/jddp-slurmh-XXXXXX)
chmod 711 "$root"
mkdir "$root/state" "$root/spool-node1" "$root/spool-node2" "$root/spool-node3"
trap 'rm -rf "$root"' EXIT
{ cat /etc/hosts; echo "$ADDR_A node1"; echo "$ADDR_B node2"; echo "$ADDR_C node3"; } > "$root/hosts"
mount --bind "$root/hosts" /etc/hosts
ctld=$(hostname -s)
cat > "$root/slurm.conf" <<EOF
ClusterName=jddphosts
SlurmctldHost=$ctld($ADDR_A)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$root/munge.socket
CredType=cred/munge
StateSaveLocation=$root/state
SlurmdSpoolDir=$root/spool-%n
SlurmctldPidFile=$root/slurmctld.pid
SlurmdPidFile=$root/slurmd-%n.pid
SlurmctldLogFile=$root/slurmctld.log
SlurmdLogFile=$root/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=6
MessageTimeout=5
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=5
NodeName=node1 NodeAddr=$ADDR_A CPUs=2 State=UNKNOWN
NodeName=node2 NodeAddr=$ADDR_B CPUs=2 State=UNKNOWN
NodeName=node3 NodeAddr=$ADDR_C CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=node[1-3] Default=YES MaxTime=INFINITE State=UP
EOF
export SLURM_CONF=$root/slurm.conf PATH=$PATH:/usr/sbin
# A command in host $1's network namespace only: not 'ip netns exec', which mounts a sysfs of its own without the
# cgroup filesystem that slurmd's cgroup plugin reads.
on() { local ns; ns=$(netns "$1") || return 2; shift; nsenter --net="/run/netns/$ns" "$@"; }
mungekey --create --force --keyfile="$root/munge.key" > /dev/null
munged -F --socket="$root/munge.socket" --key-file="$root/munge.key" --pid-file="$root/munged.pid" \
  --seed-file="$root/munged.seed" --log-file="$root/munged.log" 2>> "$root/munged.log" &
for i in $(seq 100); do [ -S "$root/munge.socket" ] && break; sleep 0.1; done
on a slurmctld -D > /dev/null 2>> "$root/slurmctld.log" &
slurmd_on() { on "$1" slurmd -D -N "$2" > /dev/null 2>> "$root/slurmd-$2.err" & }
slurmd_on a node1
slurmd_on b node2
slurmd_on c node3
sq() { on a "$@"; }
show_logs() {
  local f
  for f in "$root"/*.log "$root"/*.err; do echo "--- $(basename "$f") ---"; tail -n 20 "$f"; done >&2
}
idle() {  # idle NODE...: every NODE idle in sinfo, within 60 s
  local i n
  for ((i = 0; i < 300; i++)); do
    n=$(sq sinfo --noheader --nodes "$(IFS=,; echo "$*")" --format "%n %T" 2>/dev/null | grep -c " idle$")
    [ "$n" = "$#" ] && return 0
    sleep 0.2
  done
  echo "nodes $* not idle after 60 s:" >&2
  sq sinfo --noheader --format "%n %T" >&2
  show_logs
  return 1
}
responding() {  # responding NODE: NODE's slurmd registered (idle, or mixed with the job that lost it), in 60 s
  local i
  for ((i = 0; i < 300; i++)); do
    sq sinfo --noheader --nodes "$1" --format "%T" 2>/dev/null | grep -Eqx "idle|mixed|allocated" && return 0
    sleep 0.2
  done
  echo "node $1 not responding after 60 s: $(sq sinfo --noheader --nodes "$1" --format "%T")" >&2
  show_logs
  return 1
}
idle node1 node2 node3 || exit 1
"""

PLACES = r"""
# Each task on its own host: the node name and the host's address, as the task sees them.
sq srun -N 3 --ntasks-per-node=1 --label \
  bash -c 'echo "$SLURMD_NODENAME $(ip -4 -o addr show veth0 | awk "{print \$4}")"' \
  > "$logs/places.log" 2>&1 || { show_logs; exit 1; }
"""

FIXED = (
    CLUSTER
    + PLACES
    + r"""
out=$1
sq srun -N 3 --ntasks-per-node=1 --label "$python" "$FIT_TRAIN" "$out" 60 > "$logs/srun.log" 2>&1 || {
  echo "srun exited with $?" >&2; show_logs; exit 1; }
"""
)


def test_srun_over_three_hosts_trains_the_run_of_one_process(tmp_path, alone):
    """``srun -N 3``: three processes on three hosts, their group found from SLURM's variables, the run that one
    process trains alone; no gloo text in the output."""
    out = tmp_path / "run"
    out.mkdir()
    logs = netns_bed.run(tmp_path, FIXED, str(out), hosts=3, timeout=400, env={"FIT_TRAIN": FIT_TRAIN, **BATCHES})
    places = sorted(line.split(":", 1)[1].split() for line in logs["places"].splitlines() if ":" in line)
    assert places == [["node1", "10.231.0.1/24"], ["node2", "10.231.0.2/24"], ["node3", "10.231.0.3/24"]], logs
    for rank in (0, 1, 2):
        assert max(s for _, s in steps_taken(out, rank)) == 60, rank
    assert not CHATTER.search(logs["srun"]), logs["srun"][-3000:]
    assert_same_run(out, alone)


ELASTIC = (
    CLUSTER
    + r"""
out=$1
common=(-n 1 --devices-per-process 1 --nnodes 2:3 --coordinator node1:29500 --peer-timeout 10 --join-wait 5
        --kill-grace 1 "$FIT_TRAIN" "$out" 60)
node_is() { sq sinfo --noheader --nodes "$1" --format "%T" 2>/dev/null | grep -Eqx "$2"; }
sq srun -N 3 --ntasks-per-node=1 --no-kill --label "$python" -m jddp.launch "${common[@]}" > "$logs/srun.log" 2>&1 &
job=$!
until_ 240 step_at_least 0 8 "$out/steps0.txt" || { show_logs; exit 1; }
kill_host c  # node3's slurmd, its launcher and its process
date +%s.%N > "$out/lost_at"
until_ 120 step_at_least 1 0 "$out/steps0.txt" || { show_logs; exit 1; }
date +%s.%N > "$out/training_again_at"
echo "training again $(date +%s.%N)" >> "$logs/codes.log"
# SLURM finds node3 gone (no answer for SlurmdTimeout): DOWN, taken out of the job, which goes on (--no-kill)
until_ 60 node_is node3 "down\\*?" || { show_logs; exit 1; }
echo "node3 down $(date +%s.%N)" >> "$logs/codes.log"
slurmd_on c node3  # the host is back: its slurmd registers, and the scheduler runs a new job there
responding node3 || exit 1
echo "node3 responding again $(date +%s.%N)" >> "$logs/codes.log"
sq srun -N 1 -w node3 --label "$python" -m jddp.launch "${common[@]}" > "$logs/srun-back.log" 2>&1 &
back=$!
wait $back; echo "srun on node3 exited with $?" >> "$logs/codes.log"
until_ 60 eval '! kill -0 $job 2>/dev/null' ||
  echo "srun -N 3 still running 60 s after the run ended" >> "$logs/codes.log"
wait $job; echo "srun -N 3 exited with $?" >> "$logs/codes.log"
sq scontrol show node node3 | grep -E "State=" >> "$logs/codes.log"
"""
)


def test_elastic_under_srun_no_kill_loses_a_host_and_takes_it_back(tmp_path, alone):
    """``srun -N 3 --no-kill jddp launch --nnodes 2:3``: host c lost whole at step 8 or later (its slurmd too); the
    launchers on a and b go on as a group of two; node3's slurmd comes back, a new job's launcher there is
    admitted; the run finishes on three, equal to the one that never lost a host."""
    out = tmp_path / "run"
    out.mkdir()
    # round 1 (on two) long enough for SLURM to find node3 down (about 15 s) and its return to be admitted (about 10)
    # The returning host's launcher is another SLURM job's: it joins the run with the run's token, set for both jobs
    # (a token derived from one job's id would refuse it, as a stray: jddp.cli.job_token).
    token = {"JDDP_JOB_TOKEN": "elastic-test-" + "t" * 20}
    env = {"FIT_TRAIN": FIT_TRAIN, "STEP_SLEEP": "0.15,0.6,0.15", **BATCHES, **token}
    logs = netns_bed.run(tmp_path, ELASTIC, str(out), hosts=3, timeout=600, env=env)
    said = logs["srun"]
    assert "round 1: 2 node(s), 2 process(es) (a node lost)" in said, said[-4000:]
    assert "round 2: 3 node(s), 3 process(es) (admitting a node)" in said, said[-4000:]
    assert "srun on node3 exited with 0" in logs["codes"], logs["codes"]
    assert max(s for r, s in steps_taken(out, 0) if r == 2) == 60  # finished in round 2, on three
    assert sum(1 for rank in (0, 1, 2) if any(r == 1 for r, _ in steps_taken(out, rank))) == 2
    assert not CHATTER.search(said + logs["srun-back"]), said[-4000:]
    assert_same_run(out, alone)
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    rounds = [(r["round"], r["nodes"], r["processes"]) for r in records if r.get("split") == "goodput"]
    assert rounds == [(0, 3, 3), (1, 2, 2), (2, 3, 3)], rounds
    assert_restored_from_memory(records)
    lost = float((out / "lost_at").read_text())
    again = float((out / "training_again_at").read_text())
    print(f"under SLURM: from the loss of host c to training again on two: {again - lost:.1f} s; {logs['codes']}")
