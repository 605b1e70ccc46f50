"""Two (and three) "hosts" on one machine: network namespaces joined by a bridge (10.231.0.0/24), one launcher in
each (tests/netns_bed.py runs them).

This is the case where gloo must be told its own address: the hostname maps to
127.0.0.1 here, and without ``jddp.initialize``'s fix the peers connect to themselves.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests import models, multiprocess, netns_bed
from tests.workers import train_mlp

pytestmark = pytest.mark.multiprocess

TRAIN = str(multiprocess.WORKERS / "train_mlp.py")
COORDINATOR = "10.231.0.1:29500"  # ADDR_A of the sandbox with NET_ID=0, port 29500
# One launcher on each of the two hosts. Arguments: the worker. $RESTARTS: the launchers' --max-restarts (1 if
# unset); 0 for a run that must not fail (no spares beside it).
LAUNCH = """
for rank in 0 1; do
  host=a; [ $rank = 1 ] && host=b
  launcher $host host$rank -n 1 --devices-per-process 2 --max-restarts "${RESTARTS:-1}" --peer-timeout 10 \\
    --nnodes 2 --node-rank $rank --coordinator "$ADDR_A:29500" "$@"
done
reap host0 host1
"""


def two_hosts(tmp_path, *worker: str, script: str = LAUNCH, **env: str) -> tuple[str, str]:
    """Runs ``worker`` under ``jddp.launch`` on both hosts (``script``: how; ``env``: the workers' variables);
    returns their logs, or fails showing the sandbox's."""
    logs = netns_bed.run(tmp_path, script, *worker, env=env)
    return logs["host0"], logs["host1"]


@netns_bed.SKIP
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
up() { launcher "$1" "$2" -n 1 --devices-per-process 2 --max-restarts 2 --peer-timeout 10 --nnodes 2 \\
  --node-rank "$3" --coordinator "$ADDR_A:29500" "${@:4}"; }
KILL_HOST_AT=11 up a host0 0 "$@"
KILL_HOST_AT=11 up b host1-lost 1 "$@"
reap host1-lost
echo "host 1's launcher is gone; its replacement starts" >&2
up b host1 1 "$@"
reap host1 host0
"""


@netns_bed.SKIP
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


# One process on each of three hosts: it records the address jddp.initialize tells gloo to advertise, gathers
# every process's (host_all_gather: the coordination service), then sums a (3, 6) array sharded one row per
# process (a jitted sum: gloo, host to host).
THREE = """
import json
import numpy as np
import jddp
from jddp.runtime import jax_internals

told = []
use_gloo = jax_internals.use_gloo_with_hostname
jax_internals.use_gloo_with_hostname = lambda hostname: (told.append(hostname), use_gloo(hostname))[1]
group = jddp.initialize()
import jax
from jax.sharding import NamedSharding, PartitionSpec as P

mesh = jddp.data_mesh()
row = np.random.default_rng(group.process_id).integers(-1000, 1000, size=(1, 6)).astype(np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), row)
total = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P()))(x)
print("RESULT " + json.dumps({"advertised": jddp.host_all_gather(told), "sum": np.asarray(total).tolist()}))
"""
LAUNCH_THREE = """
rank=0
for host in a b c; do
  launcher $host host$rank -n 1 --devices-per-process 1 --nnodes 3 --node-rank $rank --coordinator "$ADDR_A:29500" "$@"
  rank=$((rank + 1))
done
reap host0 host1 host2
"""


@netns_bed.SKIP
def test_three_hosts_each_advertise_their_own_address_and_sum_through_gloo(tmp_path):
    """Three hosts joined by the bridge: each process told gloo its own host's address (10.231.0.1, .2, .3), and
    the jitted sum of their rows, which crosses gloo between every pair, is NumPy's sum of the same rows."""
    worker = tmp_path / "three.py"
    worker.write_text(THREE)
    logs = netns_bed.run(tmp_path, LAUNCH_THREE, str(worker), hosts=3, timeout=180, env={"JDDP_INIT_TIMEOUT": "30"})
    rows = [np.random.default_rng(i).integers(-1000, 1000, size=(1, 6)).astype(np.float32) for i in range(3)]
    want = {"advertised": [["10.231.0.1"], ["10.231.0.2"], ["10.231.0.3"]], "sum": np.concatenate(rows).sum(0).tolist()}
    for rank in range(3):
        log = logs[f"host{rank}"]
        results = [json.loads(line) for line in re.findall(r"RESULT (.*)", log)]
        assert results == [want], log


# A server on every host answers its letter (serve returns once it listens); `probe X Y` says what X gets from Y's:
# the letter, or the error.
TOOLS = """
serve() {
  ip netns exec "$(netns "$1")" "$python" -c '
import socket, sys
s = socket.create_server(("0.0.0.0", 7000))
while True:
    c, _ = s.accept(); c.sendall(sys.argv[1].encode()); c.close()' "$1" &
  for _ in $(seq 100); do  # until it listens
    ip netns exec "$(netns "$1")" bash -c "echo > /dev/tcp/127.0.0.1/7000" 2>/dev/null && return
    sleep 0.1
  done
}
probe() {
  echo "$1->$2 $(ip netns exec "$(netns "$1")" "$python" -c '
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7000), timeout=1) as s: print(s.recv(9).decode())
except OSError as e: print(type(e).__name__)' "$(addr "$2")")"
}
for host in a b c; do serve $host; done
probe a b; probe c b
unplug b; probe a b; probe c b; probe b a; probe a c
plug b; probe a b; probe b c
kill_host b; [ -z "$(ip netns pids "$(netns b)")" ] && echo "b is empty"; probe a b; probe a c
serve b; probe a b
wait_for probes "^b is empty$" 5 && echo "wait_for found it"
wait_for probes "^never$" 1 || echo "wait_for gave up"
"""


@netns_bed.SKIP
def test_the_bed_unplugs_plugs_and_kills_a_host(tmp_path):
    """unplug b: b and the others time out on each other, a and c still talk; plug b: back; kill_host b: nothing left
    inside b (its server refuses), a and c untouched, and b takes a new process; wait_for finds a line, or gives up."""
    logs = netns_bed.run(tmp_path, "{" + TOOLS + '} > "$logs/probes.log"', hosts=3, timeout=60)
    assert logs["probes"].splitlines() == [
        *("a->b b", "c->b b"),
        *("a->b TimeoutError", "c->b TimeoutError", "b->a TimeoutError", "a->c c"),
        *("a->b b", "b->c c"),
        *("b is empty", "a->b ConnectionRefusedError", "a->c c"),
        *("a->b b", "wait_for found it", "wait_for gave up"),
    ], logs["probes"]
