"""A private one-node SLURM cluster for the tests (tests/test_slurm.py): munged, slurmctld and slurmd on loopback.

``slurm_cluster`` (a session fixture, which a test module imports as ``slurm_cluster_fixture``) is one cluster per
pytest process, so per xdist worker, each with its own directory, ports and cluster name. It starts the three
daemons as root in a PID namespace of their own (``unshare --pid --fork --kill-child --mount-proc``): munged with a
key generated into the directory and its own socket, slurmctld and slurmd with a minimal slurm.conf (this machine's
hostname at 127.0.0.1, 2 CPUs, ``proctrack/linuxproc``, ``task/none``, state and spool in the directory). It waits
until ``sinfo`` shows the node idle and yields the ``Cluster``, whose ``environment()`` (``SLURM_CONF``) points
``srun``, ``scancel``... at it. Tearing the namespace down ends every daemon, step daemon and task in it at once,
even after a test failed mid-run, or when pytest itself is killed; the teardown then checks that no process naming
the directory is left (``pgrep -f``).

Skips, with the reason: not root; a binary missing (``.ci/run`` installs Debian's ``slurm-wlm`` and ``munge`` where
it can); ``unshare`` refused; the daemons not ready in time (quoting the end of their logs).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from jddp import net

BINARIES = (
    "munged", "mungekey", "slurmctld", "slurmd", "srun", "sinfo", "scancel", "squeue", "unshare", "setpriv", "pgrep"
)  # fmt: skip
READY_TIMEOUT_S = 60.0
SCHEDULER_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")  # variables of a cluster pytest itself may run under

# The namespace's first process: munged, then (once its socket exists) slurmctld and slurmd; when any of them ends,
# so does the script, and with it (as the namespace's init) every process in the namespace.
START = textwrap.dedent(
    """\
    cd "$1"
    munged -F --socket="$1/munge.socket" --key-file="$1/munge.key" --pid-file="$1/munged.pid" \\
        --seed-file="$1/munged.seed" --log-file="$1/munged.log" 2>> "$1/munged.log" &
    for i in $(seq 100); do [ -S "$1/munge.socket" ] && break; sleep 0.1; done
    slurmctld -D -f "$1/slurm.conf" > /dev/null 2>> "$1/slurmctld.log" &
    slurmd -D -f "$1/slurm.conf" -N "$2" > /dev/null 2>> "$1/slurmd.log" &
    wait -n
    """
)

CONF = """\
ClusterName={name}
FirstJobId={first_job}
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=5
NodeName={node} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@dataclasses.dataclass
class Cluster:
    """A running cluster: its directory, the environment for SLURM's commands, and the namespace's process."""

    root: Path
    node: str
    env: dict[str, str]
    namespace: subprocess.Popen

    def environment(self, env: dict[str, str]) -> dict[str, str]:
        """``env`` for a command against this cluster: ``SLURM_CONF`` and ``PATH`` set, any other ``SLURM_*``
        variable (from a cluster the tests themselves run under) dropped."""
        env = {k: v for k, v in env.items() if not k.startswith(SCHEDULER_PREFIXES)}
        return {**env, "SLURM_CONF": self.env["SLURM_CONF"], "PATH": self.env["PATH"]}

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A SLURM command (``sinfo``, ``scancel``...) against this cluster."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)

    def logs(self, tail: int = 15) -> str:
        """The last lines of each daemon's log."""
        out = []
        for name in ("munged.log", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            lines = path.read_text(errors="replace").splitlines()[-tail:] if path.exists() else ["(no log)"]
            out.append(f"--- {name} ---\n" + "\n".join(lines))
        return "\n".join(out)

    def node_state(self) -> str:
        done = self.run("sinfo", "--noheader", "--nodes", self.node, "--format", "%T", timeout=10)
        return done.stdout.strip() if done.returncode == 0 else f"sinfo exited {done.returncode}: {done.stderr.strip()}"

    def left(self) -> list[str]:
        """Processes that still name the cluster's directory (``pgrep -af``)."""
        done = subprocess.run(["pgrep", "-af", str(self.root)], capture_output=True, text=True)
        return [line for line in done.stdout.splitlines() if line.split()[0] != str(os.getpid())]

    def stop(self) -> None:
        """Ends the namespace (every process in it with it) and checks that nothing is left."""
        if self.namespace.poll() is None:
            # unshare ignores SIGTERM while it waits; killed, its --kill-child kills the namespace's init, and the
            # kernel every other process of the namespace.
            self.namespace.kill()
            self.namespace.wait()
        deadline = time.monotonic() + 10
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.2)
        if left:
            raise AssertionError(f"the SLURM test cluster left processes behind: {left}")


def unavailable() -> str | None:
    """Why a cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root (it starts munged, slurmctld and slurmd)"
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"SLURM is not installed ({', '.join(missing)} not found; Debian: apt-get install slurm-wlm munge)"
    return None


def first_job_id() -> int:
    """The cluster's first job id, apart from other clusters' on this machine.

    JAX's SLURM detection puts the coordinator at port ``61440 + job id % 4096`` of the job's first node: two
    clusters on one machine numbering their jobs alike would have their jobs share ports. Each xdist worker of a
    session gets its own quarter of the 4096 (workers gw0 to gw3), and within it a window of 10 ids set by the pid,
    apart from another session's in 99 cases of 100.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    quarter = int(worker) % 4 if worker.isdigit() else 0
    return 1 + 1024 * quarter + 10 * (os.getpid() % 100)


def start(root: Path) -> Cluster:
    """Writes the key and slurm.conf into ``root``, starts the daemons and waits until the node is idle.

    Raises:
      RuntimeError: the node is not idle within ``READY_TIMEOUT_S`` (the message quotes the daemons' logs).
    """
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)  # munged requires execute permission for all on its socket's directory
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    subprocess.run(["mungekey", "--create", "--force", f"--keyfile={root}/munge.key"], check=True, capture_output=True)
    node = socket.gethostname().split(".")[0]
    conf = CONF.format(
        name=f"jddp{os.getpid()}",
        first_job=first_job_id(),
        node=node,
        root=root,
        ctld_port=net.free_port(),
        slurmd_port=net.free_port(),
    )
    (root / "slurm.conf").write_text(conf)
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCHEDULER_PREFIXES)}  # pytest's own cluster's
    env.update(SLURM_CONF=str(root / "slurm.conf"), PATH=f"{os.environ.get('PATH', '')}:/usr/sbin")
    with open(root / "unshare.log", "w") as log:
        # The namespace ends when the test process does, even when it is SIGKILLed: setpriv sets the parent-death
        # signal and execs unshare (a preexec_fn would fork this process, where JAX warns at every fork: an error
        # under pytest's filterwarnings, raised in whichever test runs next).
        namespace = subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", "unshare", "--pid", "--fork", "--kill-child", "--mount-proc",
             "bash", "-c", START, "-", str(root), node],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )  # fmt: skip
    cluster = Cluster(root, node, env, namespace)
    deadline = time.monotonic() + READY_TIMEOUT_S
    state = ""
    while time.monotonic() < deadline and namespace.poll() is None:
        state = cluster.node_state()
        if state == "idle":
            return cluster
        time.sleep(0.3)
    ended = namespace.poll()
    cluster.stop()
    unshare = (root / "unshare.log").read_text(errors="replace").strip()
    raise RuntimeError(
        f"the SLURM test cluster did not start: node {node} is {state!r} after "
        f"{READY_TIMEOUT_S - max(0.0, deadline - time.monotonic()):.0f} s"
        + (f"; its namespace ended with exit {ended} ({unshare or 'no message'})" if ended is not None else "")
        + f"\n{cluster.logs()}"
    )


@pytest.fixture(scope="session", name="slurm_cluster")
def slurm_cluster_fixture():
    """A running one-node cluster for this pytest process (skips with the reason where none can run)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    # Not under pytest's basetemp: munged wants its socket's directory searchable by all, and a socket's path
    # must stay under 108 bytes.
    root = Path(tempfile.mkdtemp(prefix="jddp-slurm-"))
    try:
        cluster = start(root)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(str(error))
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
