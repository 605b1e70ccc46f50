"""Two "hosts" on one machine: two network namespaces joined by a veth pair (10.231.0.0/24), one launcher in each.

Needs root, ``unshare`` and ``ip``, and the test bed script ``../shared/tools/netns_testbed.sh``
(it builds the namespaces); skipped otherwise. Everything runs inside
``unshare --net --pid --mount --fork --kill-child``, so nothing outlives the test.
This is the case where gloo must be told its own address: the hostname maps to
127.0.0.1 here, and without ``jddp.initialize``'s fix the peers connect to themselves.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests import multiprocess

pytestmark = pytest.mark.multiprocess

TESTBED = multiprocess.ROOT.parent / "shared" / "tools" / "netns_testbed.sh"
SCRIPT = """
set -e
mkdir -p /run/netns
mount -t tmpfs netns-private /run/netns
TMPDIR={tmp} NS_PREFIX=jddpt bash {testbed} setup > {tmp}/setup.log 2>&1
for rank in 0 1; do
  ns=jddpt-a; [ $rank = 1 ] && ns=jddpt-b
  ip netns exec $ns env PYTHONPATH={root} {python} -m jddp.launch -n 1 --devices-per-process 2 --max-restarts 1 \\
    --peer-timeout 5 --nnodes 2 --node-rank $rank --coordinator 10.231.0.1:29500 {args} > {tmp}/host$rank.log 2>&1 &
done
wait
"""


def usable() -> bool:
    return os.geteuid() == 0 and shutil.which("unshare") is not None and shutil.which("ip") is not None


@pytest.mark.skipif(not usable() or not TESTBED.exists(), reason="needs root, unshare, ip and the netns test bed")
def test_two_hosts_train_like_one_process_and_restart_together(tmp_path):
    args = f"{multiprocess.WORKERS / 'train_mlp.py'} {tmp_path / 'hosts.npz'}"
    script = SCRIPT.format(tmp=tmp_path, testbed=TESTBED, root=multiprocess.ROOT, python=sys.executable, args=args)
    (tmp_path / "run.sh").write_text(script)
    unshare = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "bash"]
    done = subprocess.run([*unshare, str(tmp_path / "run.sh")], capture_output=True, text=True, timeout=300)
    logs = "\n".join((tmp_path / f"host{r}.log").read_text() for r in (0, 1) if (tmp_path / f"host{r}.log").exists())
    assert done.returncode == 0, done.stderr + logs
    assert "coordinator 10.231.0.1:29500" in logs and "processes=2" in logs, logs

    reference = tmp_path / "one.npz"
    single = subprocess.run(
        [sys.executable, str(multiprocess.WORKERS / "train_mlp.py"), str(reference)],
        env=multiprocess.environment(JDDP_LOCAL_DEVICES="4"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert single.returncode == 0, single.stderr
    a, b = dict(np.load(reference)), dict(np.load(tmp_path / "hosts.npz"))
    assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= 1e-6

    # A worker killed on host 1: both launchers restart (host 0's process sees its peer vanish) and finish.
    args = f"{multiprocess.WORKERS / 'group.py'} die 1 40 1"
    script = SCRIPT.format(tmp=tmp_path, testbed=TESTBED, root=multiprocess.ROOT, python=sys.executable, args=args)
    (tmp_path / "run.sh").write_text(script)
    done = subprocess.run([*unshare, str(tmp_path / "run.sh")], capture_output=True, text=True, timeout=300)
    host0, host1 = ((tmp_path / f"host{r}.log").read_text() for r in (0, 1))
    assert done.returncode == 0, done.stderr + host0 + host1
    assert "[0] DONE 0 attempt 1" in host0 and "[1] DONE 1 attempt 1" in host1, host0 + host1
    assert "restarting the group (1 of 1)" in host0 and "restarting the group (1 of 1)" in host1
