"""Two "hosts" on one machine: two network namespaces joined by a veth pair (10.231.0.0/24), one launcher in each.

``tools/netns_hosts.sh sandbox`` builds them inside ``unshare --net --pid --mount --fork --kill-child``,
so nothing outlives the test, even if it is killed. Needs root, ``unshare`` and ``ip``; skipped otherwise.
This is the case where gloo must be told its own address: the hostname maps to
127.0.0.1 here, and without ``jddp.initialize``'s fix the peers connect to themselves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests import models, multiprocess
from tests.workers import train_mlp

pytestmark = pytest.mark.multiprocess

HOSTS = multiprocess.ROOT / "tools" / "netns_hosts.sh"
TRAIN = str(multiprocess.WORKERS / "train_mlp.py")
COORDINATOR = "10.231.0.1:29500"  # ADDR_A of the sandbox with NET_ID=0, port 29500
# Runs inside the sandbox, which exports NETNS_A, NETNS_B and ADDR_A. Arguments: python, log folder, worker.
# $RESTARTS: the launchers' --max-restarts (1 if unset); 0 for a run that must not fail (no spares beside it).
LAUNCH = """
python=$1 logs=$2; shift 2
for rank in 0 1; do
  ns=$NETNS_A; [ $rank = 1 ] && ns=$NETNS_B
  ip netns exec "$ns" "$python" -m jddp.launch -n 1 --devices-per-process 2 --max-restarts "${RESTARTS:-1}" \\
    --peer-timeout 10 --nnodes 2 --node-rank $rank --coordinator "$ADDR_A:29500" "$@" > "$logs/host$rank.log" 2>&1 &
  pids[$rank]=$!
done
wait "${pids[0]}"; a=$?; wait "${pids[1]}"; b=$?
echo "launchers exited: host 0 with $a, host 1 with $b" >&2
[ $a = 0 ] && [ $b = 0 ]
"""


def usable() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("ip") is not None


def two_hosts(tmp_path, *worker: str, script: str = LAUNCH, **env: str) -> tuple[str, str]:
    """Runs ``worker`` under ``jddp.launch`` on both hosts (``script``: how; ``env``: the workers' variables);
    returns their logs, or fails showing the sandbox's."""
    for rank in (0, 1):
        (tmp_path / f"host{rank}.log").unlink(missing_ok=True)
    command = ["bash", str(HOSTS), "sandbox", "bash", "-c", script, "launch", sys.executable, str(tmp_path), *worker]
    # A broken test bed fails at initialisation; 60 s (not 120) lets both attempts fail within the 300 s below.
    env = multiprocess.environment(NS_PREFIX="jddpt", NET_ID="0", JDDP_INIT_TIMEOUT="60", **env)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        outcome, stderr = f"exit {done.returncode}", done.stderr
    except subprocess.TimeoutExpired as e:
        outcome, stderr = "timed out after 300 s", e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
    logs = [p.read_text() if p.exists() else "(no log)" for p in (tmp_path / f"host{r}.log" for r in (0, 1))]
    if outcome != "exit 0":
        pytest.fail(f"sandbox {outcome}:\n{stderr}\n--- host 0 ---\n{logs[0]}\n--- host 1 ---\n{logs[1]}")
    return logs[0], logs[1]


@pytest.mark.skipif(not usable(), reason="needs root, unshare and ip (iproute2) to build two network namespaces")
def test_two_hosts_train_like_one_process_and_restart_together(tmp_path):
    """The two hosts' 2 x 2 devices train as this process does on 4 of its devices (1e-6, 20 AdamW steps)."""
    import jax

    import jddp

    data = train_mlp.data_file(tmp_path / "data.npz")  # read by every process, not generated in each
    host0, host1 = two_hosts(tmp_path, TRAIN, str(tmp_path / "hosts.npz"), TRAIN_MLP_DATA=data)
    assert f"coordinator {COORDINATOR}" in host0 + host1 and "processes=2" in host0 + host1, host0 + host1

    a, _, _ = train_mlp.train(jddp.data_mesh(jax.devices()[:4]), train_mlp.load(data))
    b = dict(np.load(tmp_path / "hosts.npz"))
    assert a.keys() == b.keys() and models.max_diff(a, b) <= 1e-6

    # A worker killed on host 1: both launchers restart (host 0's process sees its peer vanish) and finish.
    host0, host1 = two_hosts(tmp_path, str(multiprocess.WORKERS / "group.py"), "die", "1", "40", "1")
    assert "[0] DONE 0 attempt 1" in host0 and "[1] DONE 1 attempt 1" in host1, host0 + host1
    assert "restarting the group (1 of 1)" in host0 and "restarting the group (1 of 1)" in host1, host0 + host1


# Host 1 dies after step 11 (its launcher and its process SIGKILLed: its in-memory snapshots go with its launcher's
# folder); a replacement host starts a new launcher there once the first is gone.
REPLACE = """
python=$1 logs=$2; shift 2
launch() {
  ip netns exec "$1" "$python" -m jddp.launch -n 1 --devices-per-process 2 --max-restarts 2 --peer-timeout 10 \\
    --nnodes 2 --node-rank "$2" --coordinator "$ADDR_A:29500" "${@:3}"
}
KILL_HOST_AT=11 launch "$NETNS_A" 0 "$@" > "$logs/host0.log" 2>&1 &
a_pid=$!
KILL_HOST_AT=11 launch "$NETNS_B" 1 "$@" > "$logs/host1-lost.log" 2>&1 &
wait $!
echo "host 1's launcher is gone; its replacement starts" >&2
launch "$NETNS_B" 1 "$@" > "$logs/host1.log" 2>&1
b=$?
wait "$a_pid"; a=$?
echo "launchers exited: host 0 with $a, host 1's replacement with $b" >&2
[ $a = 0 ] && [ $b = 0 ]
"""


@pytest.mark.skipif(not usable(), reason="needs root, unshare and ip (iproute2) to build two network namespaces")
def test_a_lost_host_is_replaced_and_resumes_from_the_survivors_memory(tmp_path):
    """The replacement host holds no snapshot: the survivor's newest (step 10, or 9 if the survivor was stopped while
    writing 10) is sent to it, the run goes on from there (the disk holds 8), consumes the examples of an
    uninterrupted run on the same two hosts and ends with its parameters, bit for bit."""
    runs, steps = {}, 16  # host 1 lost after step 11, the disk's newest step 8 (a save every 4): 5 steps to go after
    for name, script, env in (("uninterrupted", LAUNCH, {"RESTARTS": "0"}), ("lost", REPLACE, {})):
        out = tmp_path / name
        out.mkdir()
        worker = (str(multiprocess.WORKERS / "ckpt_train.py"), str(out), str(steps))
        runs[name] = (out, two_hosts(tmp_path, *worker, script=script, **env))
    host0 = runs["lost"][1][0]
    resumed = re.findall(r"RESUMED at step (\d+) attempt 1 from (\w+)", host0)
    assert resumed and resumed[0][1] == "peer" and int(resumed[0][0]) in (9, 10), host0
    read = lambda out: [json.loads(line) for line in (out / "consumed.jsonl").read_text().splitlines()]
    consumed = {r["step"]: r["ids"] for r in read(runs["uninterrupted"][0])}
    assert sorted(consumed) == list(range(1, steps + 1))
    for record in read(runs["lost"][0]):
        assert record["ids"] == consumed[record["step"]], record
    a, b = (dict(np.load(runs[name][0] / "final.npz")) for name in ("uninterrupted", "lost"))
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)
