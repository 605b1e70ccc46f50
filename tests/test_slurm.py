"""jddp under a real one-node SLURM (tests/slurm_cluster.py): ``srun -n 2`` trains the MNIST-1D MLP example as
``jddp launch -n 2`` does, stops on ``scancel --signal=TERM`` at one agreed step with exit 75, resumes from that
checkpoint bitwise, and names a task killed; gloo's chatter reaches none of their outputs, nor those of a group
started without any launcher.

The runs are 2 processes x 1 CPU device under both launchers: the same programs and the same gloo ring of 2, so the
same summation order, and the losses are compared for exact equality, not to round-off.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jddp import exitcodes, lines
from tests import multiprocess
from tests.slurm_cluster import Cluster, slurm_cluster_fixture  # noqa: F401  # the fixture slurm_cluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLE = ("-m", "examples.mnist1d.train")
# 50 epochs of 6 steps, one evaluation at the end, every step's metrics recorded: about 4 s of steps after a start
# of several seconds, long enough to be stopped mid-run.
ARGS = ("num_samples=1000", "epochs=50", "eval_every=1000", "progress=false", "log_every=1")
STEPS = 300
SIGNAL_AT = 20  # the step after which a run is signalled
TIMEOUT_S = 300
COMPARED = ("loss", "grad_norm", "accuracy")


def records(log_dir: Path, split: str = "train") -> dict[int, tuple[float, ...]]:
    """``step -> (loss, grad_norm, accuracy)`` of a run's metrics.jsonl (``split="eval"``: its evaluations)."""
    out = {}
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == split:
            out[record["step"]] = tuple(record.get(k) for k in COMPARED)
    return out


def srun(cluster: Cluster, *args: str, **env: str) -> subprocess.Popen:
    """``srun --label -n 2 python -m examples.mnist1d.train ARGS args`` on ``cluster``."""
    return subprocess.Popen(
        ["srun", "--label", "-n", "2", sys.executable, *EXAMPLE, *ARGS, *args],
        env=cluster.environment(multiprocess.environment(**env)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=multiprocess.ROOT,
    )


def finish(proc: subprocess.Popen) -> str:
    """Waits for ``proc``; returns its stdout and stderr, one after the other."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return f"{out}\n--- stderr ---\n{err}"


def wait_for_step(proc: subprocess.Popen, log_dir: Path, step: int) -> None:
    """Returns once process 0 has recorded ``step`` (metrics.jsonl is flushed per record)."""
    metrics, deadline = log_dir / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= step):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the run ended or stalled before step {step}:\n{finish(proc)}")
        time.sleep(0.1)


def job_id(cluster: Cluster) -> str:
    """The one job running on ``cluster`` (each pytest process has a cluster of its own)."""
    jobs = cluster.run("squeue", "--noheader", "--format", "%i").stdout.split()
    assert len(jobs) == 1, jobs
    return jobs[0]


def task_pid(job: str, task: int) -> int:
    """The pid of task ``task`` of ``job`` (a child of slurmstepd; ``scontrol listpids`` gives the pids inside the
    cluster's PID namespace, not ours)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = dict(v.split("=", 1) for v in (entry / "environ").read_text(errors="replace").split("\0") if "=" in v)
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            parent_name = Path(f"/proc/{parent}/comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if env.get("SLURM_JOB_ID") == job and env.get("SLURM_PROCID") == str(task) and parent_name == "slurmstepd":
            found.append(int(entry.name))
    assert len(found) == 1, f"task {task} of job {job}: pids {found}"
    return found[0]


def task_ends(output: str) -> dict[int, str]:
    """What srun said of each task that ended: ``{0: "Exited with exit code 75", 1: "Killed"}``, from lines like
    ``srun: error: vm: task 1: Killed`` or ``srun: error: vm: tasks 0-1: Exited with exit code 75`` (srun names
    tasks that end alike together)."""
    ends = {}
    for match in re.finditer(r"^srun: error: [^:]+: tasks? ([\d,-]+): (.+)$", output, re.MULTILINE):
        for part in match[1].split(","):
            first, _, last = part.partition("-")
            for task in range(int(first), int(last or first) + 1):
                ends[task] = match[2].strip()
    return ends


def no_gloo(output: str) -> None:
    assert not lines.GLOO_PIECES.search(output.encode()), output[-3000:]


def test_srun_trains_as_jddp_launch_stops_on_scancel_at_one_step_and_resumes_bitwise(slurm_cluster, tmp_path):
    """One ``jddp launch -n 2`` run of 300 steps, and the same training under ``srun -n 2`` in two jobs: the first
    stopped by ``scancel --signal=TERM`` (every task saves the agreed step k and exits 75), the second resuming from
    that checkpoint. The srun jobs' losses, gradient norms and accuracies at steps 1..k, then k+1..300 and the final
    evaluation, equal jddp launch's exactly."""
    cluster: Cluster = slurm_cluster
    launched = multiprocess.launch("-n", "2", *EXAMPLE, *ARGS, f"log_dir={tmp_path / 'launch'}", timeout=TIMEOUT_S)
    launch_output = launched.stdout + launched.stderr
    assert launched.returncode == 0, launch_output[-5000:]
    reference = records(tmp_path / "launch")
    assert sorted(reference) == list(range(1, STEPS + 1)), launch_output[-3000:]

    ckpt = f"checkpoint_dir={tmp_path / 'ckpt'}"
    first = srun(cluster, f"log_dir={tmp_path / 'first'}", ckpt, "save_every=100000")
    try:
        wait_for_step(first, tmp_path / "first", SIGNAL_AT)
        cancelled = cluster.run("scancel", "--signal=TERM", job_id(cluster))
    finally:
        first_output = finish(first)
    assert cancelled.returncode == 0, cancelled.stderr
    assert first.returncode == exitcodes.EXIT_PREEMPTED, first_output[-5000:]
    preempted = f"Exited with exit code {exitcodes.EXIT_PREEMPTED}"
    assert task_ends(first_output) == {0: preempted, 1: preempted}, first_output[-5000:]
    saved = [line for line in first_output.splitlines() if "fit: preempted; saved step" in line]
    assert len(saved) == 1, first_output[-5000:]
    step = int(saved[0].split("saved step ")[1].split(",")[0])
    assert SIGNAL_AT <= step < STEPS, saved
    # The only checkpoint is the agreed step, and both processes wrote their share of it.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == [str(step)]
    shares = sorted(p.name for p in (tmp_path / "ckpt" / str(step) / "state").glob("ocdbt.process_*"))
    assert shares == ["ocdbt.process_0", "ocdbt.process_1"], shares
    before = records(tmp_path / "first")
    assert sorted(before) == list(range(1, step + 1)), first_output[-3000:]
    assert before == {s: reference[s] for s in before}  # srun trains as jddp launch, bitwise

    second = srun(cluster, f"log_dir={tmp_path / 'second'}", ckpt, "save_every=100000")
    second_output = finish(second)
    assert second.returncode == 0, second_output[-5000:]
    after = records(tmp_path / "second")
    assert sorted(after) == list(range(step + 1, STEPS + 1)), second_output[-3000:]
    assert after == {s: reference[s] for s in after}  # the resumed job continues bitwise
    assert records(tmp_path / "second", "eval") == records(tmp_path / "launch", "eval") != {}
    for output in (launch_output, first_output, second_output):
        no_gloo(output)


def test_a_killed_task_ends_the_step_with_the_survivor_naming_it(slurm_cluster, tmp_path):
    """SIGKILL of task 1's process mid-run: task 0 names process 1 lost and exits 69 (within the peer timeout, 5 s
    here, and a round), and srun exits non-zero."""
    cluster: Cluster = slurm_cluster
    run = srun(cluster, f"log_dir={tmp_path}", JDDP_PEER_TIMEOUT="5")
    try:
        wait_for_step(run, tmp_path, SIGNAL_AT)
        os.kill(task_pid(job_id(cluster), 1), signal.SIGKILL)
    finally:
        output = finish(run)
    assert run.returncode != 0, output[-5000:]
    assert "0: jddp: process 0 of 2 lost process(es) [1]: no sign of life for more than 5 s" in output, output[-5000:]
    assert task_ends(output) == {0: f"Exited with exit code {exitcodes.EXIT_PEER_LOST}", 1: "Killed"}, output[-5000:]
    no_gloo(output)


# Under a launcher that is not `jddp launch`: after a collective (where gloo connects and prints), a line written
# to fd 1 as C++ would, and gloo's own warning about a missing peer, which is not chatter.
NATIVE_WRITER = """\
import os
import jddp

jddp.initialize()
import jax.numpy as jnp
from jax.experimental import multihost_utils

print("GATHERED", multihost_utils.process_allgather(jnp.asarray(jddp.process_index())).tolist(), flush=True)
os.write(1, b"native: a line of C++\\n")
os.write(1, b"[Gloo] Rank 0 is NOT connected to: [1]\\n")
"""


def test_gloo_chatter_does_not_reach_the_output_of_a_group_started_without_jddp_launch(tmp_path):
    """Two processes started by hand with SLURM's variables (no launcher, no SLURM needed): gloo's "is connected to"
    lines, printed to fd 1 at the group's first collective, are dropped; other native lines on fd 1 pass."""
    script = tmp_path / "native_writer.py"
    script.write_text(NATIVE_WRITER)
    codes, outputs = multiprocess.collect(multiprocess.spawn_slurm(str(script), 2, 1), timeout=TIMEOUT_S)
    shown = multiprocess.show(codes, outputs)
    assert codes == [0, 0], shown
    for output in outputs:
        assert "GATHERED [0, 1]" in output, shown
        assert "native: a line of C++" in output, shown
        assert "[Gloo] Rank 0 is NOT connected to: [1]" in output, shown
        assert "is connected to 1 peer ranks" not in output, shown
