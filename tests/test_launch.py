"""The multi-process runtime and ``jddp launch``, with real processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import jddp
from jddp import exitcodes, net
from jddp.checkpoint import checkpointer as _checkpointer  # noqa: F401
from jddp.cli import launch as launch_lib
from jddp.cli import output
from jddp.engine import mpi
from jddp.engine import own_step as _own_step  # noqa: F401
from jddp.engine import parallel as _parallel  # noqa: F401
from jddp.runtime import host as _host  # noqa: F401
from jddp.runtime import progress as _progress
from tests import models, multiprocess
from tests.workers import train_mlp

pytestmark = pytest.mark.multiprocess

GROUP = str(multiprocess.WORKERS / "group.py")
TRAIN = str(multiprocess.WORKERS / "train_mlp.py")


def lines_with(text: str, marker: str) -> list[str]:
    return [line for line in text.splitlines() if marker in line]


# ------------------------------------------------------------ equivalence


def test_every_topology_trains_to_the_same_parameters(tmp_path):
    """2 processes x 2 devices and 4 x 1 equal 1 process x 4 devices and one device (1e-6, 20 AdamW steps).

    Process 1 starts from other parameters: init must broadcast process 0's. Every
    step spanning several processes reduces one fused buffer (one operand: one gloo ring pass). The one-process
    runs are this process's, on 1 and 4 of its devices; every process reads the data this test writes once.
    """
    import jax

    data = train_mlp.data_file(tmp_path / "data.npz")
    outputs, params = {}, {}
    for name, devices in (("1x1", 1), ("1x4", 4)):
        mesh = jddp.data_mesh(jax.devices()[:devices])
        params[name], metrics, report = train_mlp.train(mesh, train_mlp.load(data))
        outputs[name] = train_mlp.result_line(mesh, metrics, report)
    for name, n, d in (("2x2", 2, 2), ("4x1", 4, 1)):
        done = multiprocess.launch(
            "-n", str(n), "--devices-per-process", str(d), TRAIN, str(tmp_path / f"{name}.npz"),
            env={"TRAIN_MLP_DATA": data},
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        outputs[name] = done.stdout
        assert f"processes={n}" in done.stdout
        params[name] = dict(np.load(tmp_path / f"{name}.npz"))
    assert "allreduce_ops=1 " in outputs["1x4"], outputs["1x4"]  # one op; per-leaf operands within one process
    for name in ("2x2", "4x1"):  # several processes: one fused operand, one gloo ring pass
        assert "allreduce_ops=1 operands=1" in outputs[name], (name, outputs[name])
    reference = params["1x1"]
    for name in ("1x4", "2x2", "4x1"):
        assert params[name].keys() == reference.keys()
        worst = models.max_diff(params[name], reference)  # NaN fails too
        assert worst <= 1e-6, (name, worst)


def test_init_names_the_process_whose_state_differs():
    """With the broadcast disabled, process 1's different values are caught by the checksum, on both processes."""
    done = multiprocess.launch("-n", "2", GROUP, "diverge")
    assert done.returncode == 0, done.stdout + done.stderr
    found = lines_with(done.stdout, "DIVERGED")
    assert len(found) == 2
    assert all("process(es) [1] differ from process 0, first at state.params['w']" in line for line in found)


# ------------------------------------------------------------ the launcher


def test_launcher_prefixes_output_filters_gloo_and_propagates_the_exit_code():
    code = (
        "import sys, jddp.cli.launch as launch\n"
        "rc = launch.main(sys.argv[1:])\n"
        "assert 'jax' not in sys.modules, 'the launcher imported JAX'\n"
        "sys.exit(rc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "-n", "2", "--devices-per-process", "2", GROUP, "hello"],
        env=multiprocess.environment(EXIT_CODE_1="3"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=multiprocess.ROOT,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "[0] HELLO 0 [[0], [1]]" in done.stdout
    assert "[1] HELLO 1 [[0], [1]]" in done.stdout
    assert "Gloo" not in done.stdout + done.stderr
    for line in done.stdout.splitlines():
        assert line[:4] in ("[0] ", "[1] "), line
    assert "first failure: process 1, failed with exit code 3" in done.stderr
    assert "the launcher imported JAX" not in done.stderr


@pytest.mark.parametrize("seed", [0, 1])
def test_gloo_chatter_never_reaches_the_output_and_progress_bars_stay_bars(seed):
    """Three threads write gloo's message to fd 1 as its C++ does (operand by operand, interleaved) while the
    script prints: every printed line arrives whole, nothing of gloo's arrives, and carriage-return updates
    stay updates, each with the prefix."""
    done = subprocess.run(
        [sys.executable, "-m", "jddp.launch", str(multiprocess.WORKERS / "gloo_noise.py"), "200", str(seed)],
        env=multiprocess.environment(),
        capture_output=True,  # bytes: text mode would turn every "\r" into "\n"
        timeout=180,
        cwd=multiprocess.ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.decode().splitlines() == [f"[0] line {i} of the script" for i in range(200)]
    assert not output.GLOO_PIECES.search(done.stdout + done.stderr)
    updates = [piece for piece in re.split(rb"(?<=\r)|(?<=\n)", done.stderr) if b"progress" in piece]
    assert updates == [f"[0] progress {i}".encode() + (b"\r" if i < 199 else b"\n") for i in range(200)], updates[:3]


def test_the_readme_main_command_runs_and_prints_no_gloo_text(tmp_path):
    """The README's main command, run as written (from a directory with the configs) but for its epochs: 2 of the
    config's 30 (62 of its 930 steps: every part of the run, the epoch boundary and the evaluations included, runs
    as in the whole one); a real two-process run; nothing of gloo's chatter in its output, every line prefixed by
    its process, the progress bars included. The whole run's time and accuracy are benchmarks/readme_command's."""
    readme = (multiprocess.ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)\n```", readme, re.S)
    assert first is not None
    args = [*shlex.split(first.group(1).split("&& jddp launch ", 1)[1]), "epochs=2"]
    (tmp_path / "configs").symlink_to(multiprocess.ROOT / "configs")
    done = subprocess.run(
        [sys.executable, "-m", "jddp.launch", *args],
        env=multiprocess.environment(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert not output.GLOO_PIECES.search((done.stdout + done.stderr).encode())
    assert re.search(r"^\[0\] .*test.*accuracy", done.stdout, re.M | re.I), done.stdout[-2000:]
    for line in done.stdout.splitlines():
        assert line[:4] in ("[0] ", "[1] "), line
    assert (tmp_path / "runs" / "mnist1d_cnn" / "loss.png").is_file()


def test_sigkilled_worker_without_restarts_fails_with_a_summary():
    done = multiprocess.launch("-n", "2", "--kill-grace", "1", "--peer-timeout", "10", GROUP, "die", "1", "12", "1")
    assert done.returncode == 128 + signal.SIGKILL, done.stdout + done.stderr
    assert "summary:" in done.stderr
    assert "first failure: process 1, killed by SIGKILL" in done.stderr
    assert "no restart left (--max-restarts 0)" in done.stderr
    assert not lines_with(done.stdout, "DONE")


@pytest.mark.parametrize("transport", ["xla", "mpi"])
def test_sigterm_is_forwarded_and_every_process_stops_at_the_same_step(transport):
    """Under ``--transport mpi`` the signal reaches mpiexec's whole process group, the coordination service that
    process 0 started included: it outlives the signal (it stops on SIGUSR1), so the processes still agree."""
    if transport == "mpi" and mpi.unavailable() is not None:
        pytest.skip(f"no MPI transport here: {mpi.unavailable()}")
    argv = ["--transport", transport, "-n", "2", "--term-timeout", "60", GROUP, "preempt"]
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jddp.launch", *argv],
        env=multiprocess.environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=multiprocess.ROOT,
    )
    ready = 0
    for line in launcher.stdout:
        ready += "READY" in line
        if ready == 2:
            break
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == exitcodes.EXIT_PREEMPTED, out + err
    stops = sorted(lines_with(out, "PREEMPTED"))
    assert len(stops) == 2, out
    assert stops[0].split(" at step ")[1] == stops[1].split(" at step ")[1]
    assert "got SIGTERM; forwarded it to every process" in err


def test_every_socket_of_a_local_run_is_on_loopback():
    """Each process lists the TCP sockets it holds (/proc/self/fd inodes matched in /proc/self/net/tcp{,6})."""
    done = multiprocess.launch("-n", "2", "--devices-per-process", "2", GROUP, "sockets")
    assert done.returncode == 0, done.stdout + done.stderr
    tables = [json.loads(line.split("SOCKETS ", 1)[1]) for line in lines_with(done.stdout, "SOCKETS ")]
    assert len(tables) == 2
    listening = [local for table in tables for state, local, _ in table if state == "LISTEN"]
    assert len(listening) >= 3  # the coordinator and one gloo listener per process
    for table in tables:
        for state, local, remote in table:
            assert local.startswith("127."), (state, local, remote)
            if state == "ESTABLISHED":
                assert remote.startswith("127."), (state, local, remote)


def test_launcher_rejects_bad_arguments_before_starting_anything():
    done = multiprocess.launch("-n", "0", GROUP, "hello")
    assert (
        done.returncode == 2
        and "argument -n/--nprocs/--nproc-per-node: must be auto, device, host or an integer of at least 1, got '0'"
        in done.stderr
    )
    done = multiprocess.launch("--peer-timeout", "inf", GROUP, "hello")  # every process crashed on it
    assert done.returncode == 2
    assert "argument --peer-timeout: must be positive and finite: a number of seconds, got 'inf'" in done.stderr
    done = multiprocess.launch("--nnodes", "2", GROUP, "hello")
    assert done.returncode == 2 and "--nnodes > 1 needs --coordinator" in done.stderr
    done = multiprocess.launch("does_not_exist.py")
    assert done.returncode == 2 and "script 'does_not_exist.py' does not exist" in done.stderr
    assert "started processes" not in done.stderr


# ------------------------------------------------------------ failure detection


def test_survivor_of_a_killed_peer_exits_within_the_bound_naming_it():
    """No launcher: process 1 SIGKILLs itself; process 0 must end with EXIT_PEER_LOST within peer timeout + 10 s."""
    peer_timeout = 5
    procs = multiprocess.spawn(GROUP, 2, 1, "die", "1", "1000", "1", JDDP_PEER_TIMEOUT=str(peer_timeout))
    codes, outputs = multiprocess.collect(procs, timeout=120)
    ended = time.time()
    assert codes[1] == -signal.SIGKILL, multiprocess.show(codes, outputs)
    assert codes[0] == exitcodes.EXIT_PEER_LOST, multiprocess.show(codes, outputs)
    killed_at = float(lines_with(outputs[1], "KILLING")[0].split()[1])
    assert ended - killed_at < peer_timeout + 10, multiprocess.show(codes, outputs)
    assert "jddp: process 0 of 2 lost process(es) [1]" in outputs[0]


PEER_TIMEOUT = 5  # the matrix below waits about this long per case (the watchdog's round is a tenth of it)
# How the victim ends (tests/workers/group.py, mode "end"). Its "exit0" is not a case: it ends the victim as
# "return" does (the same branch, a break out of the loop: exit 0 while the others train), so it ran every
# "return" case again; sys.exit with a code is "exit3".
SURVIVOR_LINE = {
    "exit3": r"waited \d+ s for process\(es\) \[{v}\], which ended early",
    "return": r"waited \d+ s for process\(es\) \[{v}\], which ended early",
    "os_exit": r"lost process\(es\) \[{v}\]: no sign of life",
    "raise": r"process {v} ended with an unhandled exception",
    "sigkill": r"lost process\(es\) \[{v}\]: no sign of life",
    "sigstop": r"lost process\(es\) \[{v}\]: no sign of life",
    "gil": r"lost process\(es\) \[{v}\]: no sign of life",
}
VICTIM_CODE = {"exit3": 3, "return": 0, "os_exit": 7, "raise": 1, "sigkill": -signal.SIGKILL}


def end_group(victim: int, how: str, spawn=multiprocess.spawn) -> tuple[list, list[str], float]:
    """Runs ``group.py end`` as two processes without a launcher; returns codes, outputs and how long after the
    victim's end the survivor exited. A victim that cannot exit by itself (stopped, or stuck holding the GIL)
    is killed once the survivor has ended."""
    procs = spawn(GROUP, 2, 1, "end", str(victim), how, JDDP_PEER_TIMEOUT=str(PEER_TIMEOUT))
    survivor = procs[1 - victim]
    try:
        survivor.wait(timeout=240)
        ended = time.time()
        if how == "gil":  # its stack dump comes from a timer armed a peer timeout before: give it time to print
            time.sleep(5)
    finally:
        for p in procs:
            if p.poll() is None and (how in ("sigstop", "gil") or p is survivor):
                p.kill()
    codes, outputs = multiprocess.collect(procs, timeout=120)
    ending = lines_with(outputs[victim], "ENDING")
    assert ending, multiprocess.show(codes, outputs)
    return codes, outputs, ended - float(ending[0].split()[1])


@pytest.mark.parametrize(
    ("victim", "how"),
    # Not os_exit: without a launcher it ends a process as sigkill does for jddp and its peer (no Python code runs
    # after either, the survivor meets the same silence), so it repeated the sigkill case. Under a launcher, which
    # reports an exit code apart from a signal, it stays a case.
    [(v, how) for v in (1, 0) for how in SURVIVOR_LINE if how != "os_exit"],
    ids=lambda x: f"process-{x}" if isinstance(x, int) else x,
)
def test_a_process_that_ends_early_ends_the_group_in_bounded_time_naming_it(victim, how):
    """Whatever way one process ends while the other trains, the other exits 69 within peer timeout + 10 s with
    a line naming it; the one that ended keeps its own exit code. Process 0 too, killed included: without a
    launcher its jddp.initialize hosts the coordination service in a child process."""
    codes, outputs, after = end_group(victim, how)
    survivor = 1 - victim
    assert codes[survivor] == exitcodes.EXIT_PEER_LOST, multiprocess.show(codes, outputs)
    assert after < PEER_TIMEOUT + 10, (after, multiprocess.show(codes, outputs))
    expected = SURVIVOR_LINE[how].format(v=victim)
    if victim == 0 and how == "sigstop":  # the coordinator is frozen: it no longer answers at all
        expected = rf"lost the coordinator \(process 0 at .*\): no answer for {PEER_TIMEOUT} s|" + expected
    assert re.search(rf"jddp: process {survivor} of 2 ({expected})", outputs[survivor]), outputs[survivor]
    if how in VICTIM_CODE:
        assert codes[victim] == VICTIM_CODE[how], multiprocess.show(codes, outputs)
    if how == "gil":  # the stuck process says where it is: faulthandler's dump, from a C thread, without the GIL
        assert f"Timeout (0:00:{PEER_TIMEOUT:02d})!" in outputs[victim], outputs[victim]
        assert re.search(r'File ".*group\.py", line \d+ in <module>', outputs[victim]), outputs[victim]


@pytest.mark.parametrize("how", ["sigkill", "exit3"])
def test_under_slurm_variables_losing_process_0_ends_the_group_naming_it(how):
    """A group found from SLURM's variables (JAX's cluster detection, no JDDP_* variables, no launcher): process 0
    hosts the coordination service in a child too, so its death is named like any other's."""
    codes, outputs, after = end_group(0, how, spawn=multiprocess.spawn_slurm)
    assert codes[1] == exitcodes.EXIT_PEER_LOST, multiprocess.show(codes, outputs)
    assert after < PEER_TIMEOUT + 10, (after, multiprocess.show(codes, outputs))
    assert re.search(rf"jddp: process 1 of 2 ({SURVIVOR_LINE[how].format(v=0)})", outputs[1]), outputs[1]
    assert "coordinator 127.0.0.1:" in outputs[0] and codes[0] == VICTIM_CODE[how]


@pytest.mark.parametrize(
    ("nodes", "victim", "how"),
    [
        (nodes, victim, how)
        for nodes in (1, 2)
        for victim in (1, 0)
        for i, how in enumerate(("exit3", "return", "os_exit", "raise", "sigkill", "sigstop"))
        # Under one launcher, each case on one process or the other, in turn: both processes are its own, and the
        # same cases on each process without a launcher are test_a_process_that_ends_early_ends_the_group_in_...
        # Across nodes what differs is how a launcher learns of the other node's end: an exit code (exit3; raise
        # and os_exit are exit codes too, tested under one launcher), an exit 0 (return), a process gone, a frozen
        # one: on either node.
        if (nodes == 1 and victim == (i + 1) % 2) or (nodes == 2 and how not in ("raise", "os_exit"))
    ]
    + [(1, 1, "gil")],
)
def test_under_launchers_a_process_that_ends_early_ends_the_group_naming_it(nodes, victim, how):
    """One launcher for both processes, or one per "host" (--nnodes 2 on loopback): the survivor prints its
    line naming the process (the launcher waits for it instead of killing it first), the group ends within
    peer timeout + 10 s, and the summary names the process that ended first, or the frozen one that its launcher
    had to stop. Losing process 0 is no different: the coordination service runs in the launcher's own process."""
    port = str(net.free_port())
    common = ("--peer-timeout", str(PEER_TIMEOUT), "--kill-grace", "1", "--term-timeout", "2")
    if nodes == 1:
        argvs = [("-n", "2", *common)]
    else:
        argvs = [
            ("--nnodes", "2", "--node-rank", str(i), "--coordinator", f"127.0.0.1:{port}", *common) for i in (0, 1)
        ]
    launchers = [
        subprocess.Popen(
            [sys.executable, "-m", "jddp.launch", *argv, GROUP, "end", str(victim), how],
            env=multiprocess.environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=multiprocess.ROOT,
        )
        for argv in argvs
    ]
    survivor = 1 - victim
    # A process frozen on node 0 never notices the group's end: node 1's launcher reports it to node 0's
    # (jddp.cli.reports), which then stops it.
    frozen_on_0 = nodes == 2 and victim == 0 and how in ("sigstop", "gil")
    results, ends = ended_launchers(launchers)
    stdout = "".join(out for out, _ in results)
    stderr = "".join(err for _, err in results)
    shown = stdout[-2000:] + stderr[-4000:]
    ending = lines_with(stdout, "ENDING")
    assert ending, shown
    # The group ends when the survivor does: with one launcher per node, its node's launcher; node 0's launcher
    # may keep the coordination service up a little longer for the other nodes (``linger``).
    group_end = ends[0] if nodes == 1 else ends[survivor]
    # A frozen victim: the survivor names it silent (its note to its launcher, or its launcher's report to node 0's),
    # and the victim's launcher SIGKILLs it at once, not after waits of its own: the launcher ends within T + 10 s.
    assert group_end - float(ending[0].split()[-1]) < PEER_TIMEOUT + 10, shown
    if how in ("sigstop", "gil") and nodes == 1:
        assert f"process {victim} was found silent by process {survivor}: stopping it (SIGKILL)" in stderr, shown
    elif frozen_on_0:
        assert f"process {victim} was found silent by a process of node 1: stopping it (SIGKILL)" in stderr, shown
    if nodes == 2 and victim == 1 and how == "sigstop":
        # Frozen on node 1 and found silent by process 0: node 0's launcher tells node 1's (jddp.cli.reports), which
        # stops it at once instead of waiting to see node 0's service gone: the bound holds at every launcher's exit.
        assert "process 1 was found silent by a process of node 0: stopping it (SIGKILL)" in stderr, shown
        assert max(ends) - float(ending[0].split()[-1]) < PEER_TIMEOUT + 10, shown
    if frozen_on_0:  # node 0's launcher: the report, the wait for its own processes, the kill grace
        assert ends[0] - ends[1] < launch_lib.PEER_LOST_WAIT_S + 5, shown
        reported = r"the group failed on another node \(node 1: process 1 stopped after losing a peer \(exit 69\)\)"
        assert re.search(reported, stderr), shown
    elif nodes == 2:
        assert max(ends) - float(ending[0].split()[-1]) < 2 * PEER_TIMEOUT + 15, shown
    expected = SURVIVOR_LINE[how].format(v=victim)
    assert re.search(rf"\[{survivor}\] jddp: process {survivor} of 2 ({expected})", stderr), shown
    code = VICTIM_CODE.get(how, -signal.SIGKILL)  # a frozen process is killed by its launcher
    victim_says = f", {exitcodes.describe(code)}"
    if how in ("sigstop", "gil"):
        victim_says = f", did not end with the group (frozen or stuck), stopped by the launcher: {victim_says[2:]}"
    if how == "return":  # named as the cause, not the peer it left (which exited 69)
        victim_says = r" exited 0 at [\d:]+ while its peers still needed it: it returned early or called sys.exit\(0\)"
    else:
        victim_says = re.escape(victim_says)
    named = re.search(rf"first failure: process {victim}{victim_says}", stderr)
    assert named or (nodes == 2 and not frozen_on_0), shown
    codes = [launcher.returncode for launcher in launchers]
    if nodes == 1:
        # A process that exited 0 while its peers still needed it fails the job: with the peers' code (69), never 0.
        expected = exitcodes.EXIT_PEER_LOST if how == "return" else code if code >= 0 else 128 - code
        assert codes == [expected], shown
    elif how == "return":
        # One launcher per node: the victim's exited 0, but it saw its peers stop waiting for it (its note): the
        # job failed on every node, and no launcher may exit 0.
        assert codes == [exitcodes.EXIT_PEER_LOST] * 2, shown
        assert re.search(rf"process {survivor} said: waited \d+ s for process\(es\) \[{victim}\], which ended", stderr)
    else:
        assert codes[survivor] == exitcodes.EXIT_PEER_LOST and codes[victim] == (code if code >= 0 else 128 - code), (
            shown
        )


def test_a_process_that_returns_early_is_a_failure_the_launcher_restarts_on():
    """A process that exits 0 while its peers still need it is the group's failure, as an exception would be:
    ``--max-restarts`` restarts the group for it, naming it, and once no restart is left the launcher exits with
    the code of the peers it left (69), not 0: a scheduler or a retry loop must not take the run for finished."""
    common = ("--peer-timeout", str(PEER_TIMEOUT), "--kill-grace", "1", "--max-restarts", "1")
    done = multiprocess.launch("-n", "2", *common, GROUP, "end", "1", "return", timeout=300)
    shown = done.stdout[-2000:] + done.stderr[-4000:]
    assert done.returncode == exitcodes.EXIT_PEER_LOST, shown
    assert len(lines_with(done.stdout, "ENDING")) == 2, shown  # it ended early in both attempts
    assert "restarting the group (1 of 1)" in done.stderr, shown
    cause = r"first failure: process 1 exited 0 at [\d:]+ while its peers still needed it"
    assert len(re.findall(cause, done.stderr)) == 2, shown  # named in the restart's summary and in the last one
    assert "first failure: process 0" not in done.stderr, shown
    assert "no restart left (--max-restarts 1)" in done.stderr, shown


def ended_launchers(launchers: list[subprocess.Popen]) -> tuple[list, list[float]]:
    """Each launcher's (stdout, stderr) and the time it ended."""
    results: list = [None] * len(launchers)
    ends = [0.0] * len(launchers)

    def wait(i: int) -> None:
        try:
            results[i] = launchers[i].communicate(timeout=240)
        except subprocess.TimeoutExpired:  # a hung launcher: stopped (it stops its processes), the test fails
            launchers[i].send_signal(signal.SIGTERM)
            results[i] = launchers[i].communicate(timeout=60)
        ends[i] = time.time()

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(len(launchers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, ends


# ------------------------------------------------------------ a collective made by a subset of the processes

# The calls every process must make (``progress.collective_call``) register their names as their modules are
# imported (checkpointer, parallel, host, distributed: imported above): a new one is a case the day it is declared.
ALONE = str(multiprocess.WORKERS / "alone.py")
# Calls whose lone call cannot be told from the others' calls, with the reason; every other is a case.
ALONE_ACCEPTED = {
    "DataParallel.step": "an extra step pairs with the peers' next step (the same program): the run goes on a step "
    "apart and ends at the last step by the ended-early rule (exit 69 naming it, T + 10 s)",
}
ALONE_CASES = [c for c in _progress.COLLECTIVE_CALLS if c not in ALONE_ACCEPTED] + ["jit"]


@pytest.mark.slow
@pytest.mark.parametrize("call", ALONE_CASES)
def test_a_collective_made_by_one_process_alone_is_named_with_the_call(call, tmp_path):
    """Process 0 makes ``call`` alone at step 3 (the DDP habit ``if rank == 0: checkpointer.save(...)``) while
    process 1 steps on: the run fails (never 0), the processes and the launcher's summary name the call and the
    process that made it alone, and the innocent process is never called "frozen or stuck". ``jit``: a jitted
    collective of the script's own, which jddp cannot see: gloo stops process 0 (an error, or an abort from C++
    that prints its Python stack), whose output names the script's call; the others name the lost process."""
    done = multiprocess.launch(
        "-n", "2", "--peer-timeout", str(PEER_TIMEOUT), "--kill-grace", "1", ALONE, call, str(tmp_path), timeout=240
    )
    shown = done.stdout[-3000:] + done.stderr[-5000:]
    assert done.returncode not in (0, None), shown
    assert "frozen or stuck" not in done.stderr, shown
    if call == "jit":
        assert re.search(r'\[0\] +File ".*alone\.py", line \d+ in plain_jit', done.stderr), shown
        assert re.search(r"\[1\] jddp: process 1 of 2 .*process 0 ", done.stderr), shown
        return
    named = f"process 0 called {call} alone (jddp collective call #"
    # Process 0 exits 1 (the script's error) naming it too, unless gloo aborted it first (SIGABRT, its stack shown).
    aborted = done.returncode == 128 + signal.SIGABRT
    assert done.returncode == 1 or aborted, shown
    for p in (1,) if aborted else (0, 1):
        line = [x for x in done.stderr.splitlines() if x.startswith(f"[{p}] jddp: process {p} of 2 ")]
        assert line and named in line[-1] and "process 1 was in DataParallel.step" in line[-1], shown
    assert re.search(rf"cause, as process\(es\) \[[01, ]+\] found it: {re.escape(named)}", done.stderr), shown


@pytest.mark.slow
def test_a_process_that_exits_while_its_peer_waits_in_a_collective_of_the_scripts_own_is_named():
    """The failure table's row: process 1 exits 0 while process 0 waits in ``multihost_utils.process_allgather``.
    Gloo's key-value wait (30 s, fixed) fails first, then process 0 finds the peer gone within the peer timeout and
    exits 69 naming it; the launcher exits 69 naming process 1, never 0, never a hang."""
    worker = str(multiprocess.WORKERS / "exit_in_own_collective.py")
    done = multiprocess.launch("-n", "2", "--peer-timeout", "10", worker, timeout=240)
    shown = done.stdout[-3000:] + done.stderr[-5000:]
    assert done.returncode == exitcodes.EXIT_PEER_LOST, shown
    assert "process 1 exited 0 at" in done.stderr and "while its peers still needed it" in done.stderr, shown
    assert "process 0 returned after" not in done.stdout + done.stderr, shown


def test_barrier_times_out_naming_the_missing_process():
    codes, outputs = multiprocess.collect(multiprocess.spawn(GROUP, 2, 1, "barrier"), timeout=120)
    assert codes == [0, 0], multiprocess.show(codes, outputs)
    assert (
        "TIMEOUT jddp.barrier('sync') call 1 timed out after 2 s on process 0: process(es) [1] did not arrive"
        in (outputs[0])
    )


# ------------------------------------------------------------ initialize's errors


def run_initialize(timeout: float = 120, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``jddp.initialize(init_timeout_s=3)`` in a fresh process; returns its result and how long the call took
    (timed inside the process, so Python's start and JAX's import on a loaded machine do not count)."""
    code = (
        "import time, jddp, jax\n"
        "start = time.monotonic()\n"
        "try:\n"
        "    jddp.initialize(init_timeout_s=3)\n"
        "except Exception as e:\n"
        "    print(f'ERROR {type(e).__name__}: {e}')\n"
        "print(f'SECONDS {time.monotonic() - start}')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=multiprocess.environment(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("SECONDS ")]
    return done, seconds[0] if seconds else float("inf")


def test_unreachable_coordinator_fails_within_the_timeout_with_a_python_error():
    port = net.free_port()  # nobody listens there
    done, seconds = run_initialize(JDDP_COORDINATOR=f"127.0.0.1:{port}", JDDP_NUM_PROCESSES="2", JDDP_PROCESS_ID="1")
    assert done.returncode == 0, done.stderr
    assert (
        f"ERROR TimeoutError: jddp.initialize: process 1 of 2 could not reach the coordinator at 127.0.0.1:{port}"
        in (done.stdout)
    )
    assert seconds < 3 + 10


def test_coordinator_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done, _ = run_initialize(JDDP_COORDINATOR=f"127.0.0.1:{port}", JDDP_NUM_PROCESSES="2", JDDP_PROCESS_ID="0")
    assert f"ERROR OSError: [Errno 98] The coordinator address 127.0.0.1:{port} is already in use" in done.stdout


def test_launcher_with_a_coordinator_port_in_use_says_so_and_starts_nothing(tmp_path):
    """The launcher's coordination service cannot start: the same clear error, exit 1, no process started."""
    marker = tmp_path / "started"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "jddp.launch", "-n", "2", "--coordinator", f"127.0.0.1:{port}", str(script)],
            env=multiprocess.environment(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 1, done.stderr
    assert f"The coordinator address 127.0.0.1:{port} is already in use" in done.stderr, done.stderr
    assert not marker.exists()


def test_process_id_must_be_below_the_process_count(monkeypatch):
    monkeypatch.setenv("JDDP_COORDINATOR", "127.0.0.1:29500")
    monkeypatch.setenv("JDDP_NUM_PROCESSES", "2")
    monkeypatch.setenv("JDDP_PROCESS_ID", "2")
    with pytest.raises(ValueError, match=r"process_id=2 \(JDDP_PROCESS_ID\) must be in \[0, num_processes=2\)"):
        jddp.initialize()


def test_initialize_after_the_backend_started_is_a_clear_error(monkeypatch):
    import jax

    monkeypatch.setenv("JDDP_COORDINATOR", "127.0.0.1:29500")
    monkeypatch.setenv("JDDP_NUM_PROCESSES", "2")
    monkeypatch.setenv("JDDP_PROCESS_ID", "1")
    jax.devices()  # pytest's process runs JAX already
    with pytest.raises(RuntimeError, match=r"must run before JAX starts its backend"):
        jddp.initialize()


def test_exit_code_descriptions():
    assert exitcodes.describe(-6).startswith("aborted (SIGABRT)")
    assert exitcodes.describe(137) == "killed by SIGKILL"
    assert exitcodes.is_peer_failure(exitcodes.EXIT_PEER_LOST) and exitcodes.is_peer_failure(134)
    assert not exitcodes.is_peer_failure(1)


@pytest.mark.skipif(not multiprocess.ipv6_loopback(), reason="no IPv6 loopback")
def test_an_ipv6_coordinator_works():
    port = net.free_port()
    done = multiprocess.launch("-n", "2", "--coordinator", f"[::1]:{port}", GROUP, "hello")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[1] HELLO 1 [[0], [1]]" in done.stdout


def shares(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        if "SHARE " in line:
            out[int(line[1 : line.index("]")])] = json.loads(line.split("SHARE ", 1)[1])
    return out


def test_with_cpu_share_each_process_gets_its_share_of_the_cores():
    cores = sorted(os.sched_getaffinity(0))
    affinity = str(multiprocess.WORKERS / "affinity.py")
    done = multiprocess.launch("-n", "2", "--cpu-share", affinity)
    assert done.returncode == 0, done.stderr
    got = shares(done.stdout)
    assert sorted(got) == [0, 1]
    if len(cores) >= 2:  # every core used, none shared
        assert sorted(got[0]["cores"] + got[1]["cores"]) == cores
        assert not set(got[0]["cores"]) & set(got[1]["cores"])
    for share in got.values():
        assert share["omp"] == str(len(share["cores"]))
        assert ("--xla_cpu_multi_thread_eigen=false" in share["xla_flags"]) == (len(share["cores"]) == 1)
    done = multiprocess.launch("-n", "2", affinity)  # the default: processes left to the OS scheduler
    assert all(s["cores"] == cores and s["omp"] is None for s in shares(done.stdout).values())
    done = multiprocess.launch("-n", "2", "--cpu-share", affinity, env={"OMP_NUM_THREADS": "7"})
    assert all(s["omp"] == "7" for s in shares(done.stdout).values())  # the user's own setting stays


def two_launchers(*argv: str, port: int | None = None) -> list[subprocess.Popen]:
    """``jddp launch --nnodes 2`` twice on loopback, one launcher per "host", each with one process."""
    port = port or net.free_port()
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jddp.launch",
                *("--nnodes", "2", "--node-rank", str(i), "--coordinator", f"127.0.0.1:{port}"),
                *argv,
            ],
            env=multiprocess.environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=multiprocess.ROOT,
        )
        for i in (0, 1)
    ]


def test_under_two_launchers_a_failure_on_node_1_restarts_node_0_at_once():
    """Node 1's launcher reports its failed attempt to node 0's (jddp.cli.reports): with a restart to follow, node 0
    stops its processes at once instead of waiting the peer timeout for them to notice, and both nodes finish the
    second attempt."""
    peer_timeout = 60
    common = ("--max-restarts", "1", "--kill-grace", "1", "--peer-timeout", str(peer_timeout))
    launchers = two_launchers(*common, GROUP, "die", "1", "12", "1")
    results, ends = ended_launchers(launchers)
    stdout = "".join(out for out, _ in results)
    stderr = "".join(err for _, err in results)
    shown = stdout[-2000:] + stderr[-4000:]
    assert [launcher.returncode for launcher in launchers] == [0, 0], shown
    assert "the group failed on another node (node 1: process 1 killed by SIGKILL); a restart follows" in stderr
    assert "first failure on another node (node 1: process 1 killed by SIGKILL)" in stderr, shown
    assert sorted(lines_with(stdout, "DONE")) == ["[0] DONE 0 attempt 1", "[1] DONE 1 attempt 1"], shown
    killed = float(lines_with(stdout, "KILLING")[0].split()[-1])
    assert max(ends) - killed < peer_timeout, shown  # process 0 was not left to find its peer lost by itself


def test_a_jobwide_sigterm_without_a_launcher_saves_at_the_same_step_the_service_outlives_it():
    """SLURM's ``scancel`` (and mpiexec, and a terminal's Ctrl-C) signals every process of the job: without a
    launcher that includes the coordination service process 0 started as its child. The service ignores it
    (process 0 stops it with SIGUSR1), so both processes agree on a step and exit 75, and no service is left."""
    procs = multiprocess.spawn_slurm(GROUP, 2, 1, "preempt")
    try:
        ready = 0
        assert procs[0].stdout is not None
        for line in procs[0].stdout:
            ready += "READY" in line
            if ready:
                break
        time.sleep(0.5)
        service = [int(p) for p in Path(f"/proc/{procs[0].pid}/task/{procs[0].pid}/children").read_text().split()]
        assert service, "process 0 started no coordination service"
        for pid in [p.pid for p in procs] + service:
            os.kill(pid, signal.SIGTERM)
    finally:
        codes, outputs = multiprocess.collect(procs, timeout=120)
    assert codes == [exitcodes.EXIT_PREEMPTED] * 2, multiprocess.show(codes, outputs)
    stops = sorted(line for out in outputs for line in out.splitlines() if "PREEMPTED" in line)
    assert len(stops) == 2 and stops[0].split(" at step ")[1] == stops[1].split(" at step ")[1], stops
    time.sleep(1)
    assert not [p for p in service if Path(f"/proc/{p}").exists() and "Z" not in _state(p)], "the service outlived"


def test_a_jobwide_sigterm_under_the_launcher_saves_at_the_same_step_the_service_outlives_it():
    """The same job-wide SIGTERM (scancel, a time limit, a cgroup kill) under ``jddp launch``: the launcher, the
    coordination service it runs and the workers all get it. The service ignores it (the launcher stops it with
    SIGUSR1), so the workers agree on a step and exit 75; before, the service died at once and the workers' save
    failed on the lost coordinator (exit 1, the launcher 143)."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jddp.launch", "-n", "2", GROUP, "preempt"],
        env=multiprocess.environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=multiprocess.ROOT,
    )
    try:
        assert launcher.stdout is not None
        seen = []
        for line in launcher.stdout:
            seen.append(line)
            if "READY" in line:
                break
        children = [int(p) for p in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()]
        watcher = [p for p in children if b"orphans.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
        children = [p for p in children if p not in watcher]  # the orphan watcher is no part of the job's signal
        assert len(children) == 3, (children, seen)  # the service and two workers
        for pid in [launcher.pid, *children]:
            os.kill(pid, signal.SIGTERM)
        out, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    shown = "".join(seen) + out + err[-3000:]
    assert launcher.returncode == exitcodes.EXIT_PREEMPTED, shown
    stops = sorted(line for line in (out + "".join(seen)).splitlines() if "PREEMPTED" in line)
    assert len(stops) == 2 and stops[0].split(" at step ")[1] == stops[1].split(" at step ")[1], shown
    time.sleep(1)
    assert not [p for p in children if Path(f"/proc/{p}").exists() and "Z" not in _state(p)], "a process outlived"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
    except (OSError, IndexError):
        return "Z"
