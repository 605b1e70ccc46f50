"""``jddp launch``'s spare workers (``jddp.cli.spare``) and the run's snapshot directory (``JDDP_SNAPSHOT_DIR``)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jddp.cli import launch as launch_lib
from jddp.cli import spare as spare_lib
from jddp.cli.launch import environment as launch_environment
from jddp.cli.launch import spares as spares_lib
from jddp.cli.launch import supervisor
from tests import multiprocess

pytestmark = pytest.mark.multiprocess

RESTART = str(multiprocess.WORKERS / "spare_restart.py")
# What the handed script reports: run as `python -u script.py` / `python -u -m module` would run it?
REPORT = """\
import json, os, sys
from jddp.runtime import jax_internals
print("REPORT " + json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "env": dict(os.environ),
    "backend_started": jax_internals.backend_started(), "jax_imported": "jax" in sys.modules}))
print("ON STDERR", file=sys.stderr)
sys.exit(int(os.environ["EXIT_WITH"]))
"""


def reports(text: str, prefix: str) -> list[dict]:
    marker = prefix + "REPORT "
    return [json.loads(line[len(marker) :]) for line in text.splitlines() if line.startswith(marker)]


def test_a_spare_handed_a_role_runs_the_target_as_python_would(tmp_path, monkeypatch, capfd):
    """Two spares, one handed a script (through a symbolic link), one a module: each runs with the role's environment
    alone, its argv, the ``sys.path[0]`` Python gives, as ``__main__``, its lines prefixed with its process index,
    its exit code its own; the spare's imports did not start JAX's backend (``jddp.initialize`` would fail)."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "report.py").write_text(REPORT)
    (tmp_path / "link.py").symlink_to(tmp_path / "scripts" / "report.py")
    (tmp_path / "report_module.py").write_text(REPORT)
    monkeypatch.chdir(tmp_path)  # a spare's working directory is the launcher's: sys.path[0] under -m
    monkeypatch.setenv("PYTHONPATH", str(multiprocess.ROOT))
    config = launch_lib.LaunchConfig(target="link.py", nprocs=4, max_restarts=1, cpu_share=True)
    launcher = supervisor.Launcher(config)
    monkeypatch.setenv("GONE_BEFORE_THE_ROLE", "1")  # the spare's start had it, the role does not: not seen
    spares = {rank: launcher.spares.start(rank) for rank in (1, 2)}
    monkeypatch.delenv("GONE_BEFORE_THE_ROLE")
    shares = launch_lib.cpu_shares(sorted(os.sched_getaffinity(0)), 4)
    for rank, spare in spares.items():  # --cpu-share: pinned from its start to its local rank's cores
        assert sorted(os.sched_getaffinity(spare.popen.pid)) == shares[rank]
    unused = launcher.spares.start(3)  # its launcher gone (the socket closed): it ends, running nothing
    unused.channel.close()
    roles = {1: (False, "link.py", ["a b", "--c"]), 2: (True, "report_module", ["x"])}
    envs = {}
    # Spare 1 gets its role after it said it is ready (its message unread: the launcher's socket closes with data
    # in it), spare 2 while it is still importing.
    assert select.select([spares[1].channel], [], [], 120)[0]
    for rank, spare in spares.items():
        env = launch_environment.environment(config, rank, "127.0.0.1:1", 1) | {"EXIT_WITH": str(rank + 4)}
        envs[rank] = env | {launch_lib.ENV_STDOUT_FD: str(spare.stdout_fd)}
        module, target, args = roles[rank]
        assert spare.hand(spare_lib.role(envs[rank], module=module, target=target, args=args), rank + 10)
    codes = {rank: spare.popen.wait(120) for rank, spare in spares.items()}
    codes[3] = unused.popen.wait(120)
    for spare in [*spares.values(), unused]:
        for reader in spare.readers:
            reader.join(10)
    out, err = capfd.readouterr()
    assert codes == {1: 5, 2: 6, 3: 0}, out + err
    (script,) = reports(out, "[11] ")
    (module,) = reports(out, "[12] ")
    assert script["name"] == module["name"] == "__main__"
    assert script["argv"] == ["link.py", "a b", "--c"]
    assert script["path0"] == str(tmp_path / "scripts")  # the script's directory, the link resolved
    assert module["argv"] == [str(tmp_path / "report_module.py"), "x"] and module["path0"] == str(tmp_path)
    assert script["env"] == envs[1] and module["env"] == envs[2]
    assert script["jax_imported"] and not script["backend_started"] and not module["backend_started"]
    assert "[11] ON STDERR" in err and "[12] ON STDERR" in err
    assert not [line for line in out.splitlines() if line.startswith("[spare")], out


def test_a_restart_hands_the_roles_to_the_spares_and_a_dead_spare_is_replaced_by_a_new_process():
    """On attempt 0 one of the two spares is killed: attempt 1 runs one process in the other spare and starts the
    other anew. The snapshot directory is the same on both attempts (a file written on the first is still there),
    and gone after."""
    # --no-standby: spares with their imports only (forked from the zygote, at once ready: handed a standby role,
    # the one killed would end its whole generation, and both processes would be forked anew)
    done = multiprocess.launch(
        "-n", "2", "--max-restarts", "1", "--no-standby", "--peer-timeout", "10", RESTART, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = {}
    for line in done.stdout.splitlines():
        if " ATTEMPT " in f" {line[4:]}":
            _, attempt, _, process, _, spare, _, directory, _, kept = line[4:].split()
            assert line.startswith(f"[{process}] "), line
            seen[int(attempt), int(process)] = (spare == "True", directory, kept == "True")
    assert sorted(seen) == [(a, p) for a in range(2) for p in range(2)], done.stdout
    assert [seen[0, p][0] for p in range(2)] == [False, False]
    assert sorted(seen[1, p][0] for p in range(2)) == [False, True], done.stdout  # one spare was killed
    # A restart follows: the launcher stops the survivor at once rather than wait the peer timeout for it (this test
    # took the place of test_launch's test_sigkilled_worker_restarts_the_group_and_the_run_completes).
    assert "process 1 killed by SIGKILL; a restart follows: stopping the others" in done.stderr
    assert "lost process(es)" not in done.stderr
    assert "stopped by the launcher for the restart (SIGKILL)" in done.stderr
    assert "first failure: process 1, killed by SIGKILL" in done.stderr
    assert "restarting the group (1 of 1)" in done.stderr
    assert "handed to their spares, not started anew" in done.stderr
    assert "had ended: starting the process anew" in done.stderr
    directories = {directory for _, directory, _ in seen.values()}
    assert len(directories) == 1, seen
    (directory,) = directories
    assert Path(directory).name.startswith(launch_lib.SNAPSHOT_PREFIX)
    assert all(kept for (attempt, _), (_, _, kept) in seen.items() if attempt > 0)
    assert not os.path.exists(directory)
    assert sorted(line for line in done.stdout.splitlines() if "DONE" in line) == ["[0] DONE 0", "[1] DONE 1"]


SLEEPER = """\
import os, sys, time
print("SNAPSHOT", os.environ.get("JDDP_SNAPSHOT_DIR"), os.getpid(), flush=True)
if sys.argv[1:] == ["sleep"]:
    time.sleep(120)
"""


def test_the_snapshot_directory_of_a_killed_launcher_is_removed_by_the_next_and_a_user_s_is_kept(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    killed = subprocess.Popen(
        [sys.executable, "-m", "jddp.launch", str(script), "sleep"],
        env=multiprocess.environment(),
        stdout=subprocess.PIPE,
        text=True,
        cwd=multiprocess.ROOT,
    )
    assert killed.stdout is not None
    _, _, directory, worker = killed.stdout.readline().split()
    killed.kill()  # SIGKILL: no finally
    killed.wait()
    killed.stdout.close()
    os.kill(int(worker), signal.SIGKILL)  # in a session of its own, it outlives its launcher
    assert os.path.isdir(directory) and Path(directory).name.startswith(f"jddp-snapshots-{killed.pid}-")
    base = os.path.dirname(directory)
    running = Path(base) / f"{launch_lib.SNAPSHOT_PREFIX}{os.getpid()}-running"  # a launcher that still runs
    running.mkdir()
    try:
        done = multiprocess.launch(str(script))
        assert done.returncode == 0, done.stderr
        _, own, _ = next(line for line in done.stdout.splitlines() if "SNAPSHOT" in line)[4:].split()
        assert own != directory and not os.path.exists(own)  # its own, removed at its end
        assert not os.path.exists(directory), "the killed launcher's directory was not removed"
        # Any launcher of the host that starts meanwhile may sweep it first (other tests run launchers beside this)
        swept = f"removed {directory}, the snapshot directory of a launcher that no longer runs" in done.stderr
        assert swept or not any(launch_lib.SNAPSHOT_PREFIX in line for line in done.stderr.splitlines()), done.stderr
        assert running.is_dir()
    finally:
        running.rmdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    done = multiprocess.launch(str(script), env={"JDDP_SNAPSHOT_DIR": str(mine)})
    assert done.returncode == 0 and f"[0] SNAPSHOT {mine} " in done.stdout, done.stdout + done.stderr
    assert mine.is_dir()  # the user's own: never removed by the launcher


STANDBY_STEPS = str(multiprocess.WORKERS / "standby_steps.py")


def test_a_standby_that_dies_is_replaced_by_new_processes_and_one_never_woken_never_trains(tmp_path):
    """A loop of the script's own (no jddp.fit, no Checkpointer: standby waits at its first ``DataParallel.step``).
    The standby process of attempt 1 raises before it stands by: the launcher says so with what it printed, and the
    restart starts new processes. Attempt 2's standby processes stand by (the launcher says so) and are never woken:
    they take no step, and their output is dropped."""
    done = multiprocess.launch("-n", "2", "--max-restarts", "2", "--peer-timeout", "10", STANDBY_STEPS, str(tmp_path),
                               timeout=240)  # fmt: skip
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown
    assert (
        "the standby process for process 1 of attempt 1 ended before it stood by (failed with exit code 1)"
        in done.stderr
    ), shown
    assert "[1] RuntimeError: STANDBY DIES" in done.stderr, shown  # what it printed, released
    assert "0 of 2 standby process(es) stood by at the failure: ending them, starting the processes anew" in shown
    assert done.stderr.count(launch_lib.STANDBY_READY) == 1, shown  # attempt 2's, during attempt 1
    notes = [line.split() for line in (tmp_path / "notes").read_text().splitlines()]
    ready = {(int(a), int(p)): pid for kind, a, p, pid, *_ in notes if kind == "READY"}
    assert set(ready) == {(a, p) for a in range(3) for p in range(2)}, notes
    steps = {(int(a), int(p), pid) for kind, a, p, pid, *_ in notes if kind == "STEP"}
    assert {(a, p) for a, p, _ in steps} == {(a, p) for a in range(2) for p in range(2)}, notes  # none in attempt 2
    assert {pid for *_, pid in steps} == {ready[a, p] for a in range(2) for p in range(2)}
    assert [n[-1] for n in notes if n[:3] == ["STEP", "1", "0"]][-1] == "29"
    assert not [line for line in done.stdout.splitlines() if not line.startswith(("[0] ", "[1] "))], done.stdout


def test_a_snapshot_directory_is_swept_when_no_launcher_holds_its_lock_whatever_its_pid_says(tmp_path):
    """The lock decides (it holds across PID namespaces, where a pid names nobody or somebody else); a directory
    without one (an older launcher's) is judged by its pid; the directory a launcher makes is locked from the
    moment it has its name."""
    import fcntl

    dead = 2**22 + 12345  # above pid_max's default: no process here

    def made(name: str, *, lock: bool) -> Path:
        path = tmp_path / f"{launch_lib.SNAPSHOT_PREFIX}{name}"
        path.mkdir()
        if lock:
            (path / launch_lib.SNAPSHOT_LOCK).touch()
        return path

    held = made(f"{dead}-held", lock=True)  # its launcher runs in another PID namespace
    fd = os.open(held / launch_lib.SNAPSHOT_LOCK, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    released = made(f"{os.getpid()}-released", lock=True)  # a live pid here, but nobody holds the lock
    old_dead, old_live = made(f"{dead}-old", lock=False), made(f"{os.getpid()}-old", lock=False)
    new, new_fd = launch_lib.make_locked_dir(str(tmp_path))
    try:
        removed = launch_lib.sweep_snapshots(str(tmp_path))
        assert sorted(removed) == sorted([str(released), str(old_dead)])
        assert held.is_dir() and old_live.is_dir() and os.path.isdir(new)
        assert Path(new).name.startswith(f"{launch_lib.SNAPSHOT_PREFIX}{os.getpid()}-")
    finally:
        os.close(fd)
        os.close(new_fd)
    assert sorted(launch_lib.sweep_snapshots(str(tmp_path))) == sorted([str(held), new])  # their locks now free


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory):
    """An uninterrupted 2-process run of the checkpointing worker (``tests.test_checkpoint``'s)."""
    from tests import test_checkpoint

    return test_checkpoint.reference_run(tmp_path_factory)


def survivors(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (spares, standby processes, services of one test's run)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


WOKEN = re.compile(r"process\(es\) 0 \(pid (\d+)\), 1 \(pid (\d+)\) woken from standby")


def test_a_second_kill_right_after_a_restart_is_taken_by_the_standby_of_the_attempt_after(
    tmp_path, two_process_reference
):
    """``--standby-depth 2``: attempts 1 and 2 stand by while attempt 0 trains. Process 1 SIGKILLs itself after step 9
    once both stand by; the restart wakes attempt 1, and this test SIGKILLs its process 1 as soon as the launcher names
    it (within 1 s of the restart): attempt 2 is woken from standby too (never started anew), and the run ends bitwise
    equal to the uninterrupted one. No process of the run outlives the launcher (the spares of attempt 3's generation
    started when attempt 2 was woken, standby or not, and the services). Red with depth 1: attempt 2's standby
    processes, started when attempt 1 was woken, are not standing by at the second kill."""
    from tests import test_checkpoint

    ready, marker = tmp_path / "standby-ready", str(tmp_path / "memory")
    (tmp_path / "run").mkdir()
    env = multiprocess.environment(JDDP_SNAPSHOT_DIR=marker, KILL_ONCE=f"9:{ready}")
    steps = str(test_checkpoint.TWO_PROCESS_STEPS)
    argv = [sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", "3", "--standby-depth", "2",
            "--peer-timeout", "15", test_checkpoint.WORKER, str(tmp_path / "run"), steps]  # fmt: skip
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=multiprocess.ROOT)  # fmt: skip
    said: list[str] = []
    printed: list[str] = []
    kills: list[float] = []  # seconds from the launcher's line naming the woken processes to this test's SIGKILL

    def read_stderr() -> None:
        first_ready = None
        assert launcher.stderr is not None
        for line in launcher.stderr:
            said.append(line)
            if launch_lib.STANDBY_READY in line and first_ready is None:
                first_ready = time.monotonic()
                # never hangs: without a deeper generation (depth 1) the kill comes anyway, and the test fails below
                threading.Timer(120, ready.touch).start()
            if spares_lib.LATER_READY in line:
                ready.touch()
            woken = WOKEN.search(line)
            if woken and not kills:
                seen = time.monotonic()
                os.kill(int(woken.group(2)), signal.SIGKILL)
                kills.append(time.monotonic() - seen)

    def read_stdout() -> None:
        assert launcher.stdout is not None
        printed.extend(launcher.stdout)

    readers = [threading.Thread(target=read_stderr, daemon=True), threading.Thread(target=read_stdout, daemon=True)]
    multiprocess.wait_read(launcher, readers, 300)
    shown = "".join(printed) + "".join(said)
    assert launcher.returncode == 0, shown
    assert len(WOKEN.findall(shown)) == 2, shown  # both restarts woken from standby
    assert kills and kills[0] < 1.0, (kills, shown)
    assert "starting the processes anew" not in shown and "handed to their spares" not in shown, shown
    log = test_checkpoint.assert_same_run(tmp_path / "run", two_process_reference, "second kill after a restart")
    assert {r["attempt"] for r in log} <= {0, 1, 2} and 2 in {r["attempt"] for r in log}, shown
    deadline = time.monotonic() + 30  # services stop in the background (10 s at most): joined before the exit
    while survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not survivors(marker), [Path(f"/proc/{p}/cmdline").read_bytes() for p in survivors(marker)]


UNPRIVILEGED = """\
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from jddp.cli.launch import config, snapshots, spares
from jddp.cli.output import Output

child = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a session, so an autogroup, of its own
pool = spares.SparePool(config.LaunchConfig(target="x", module=True, standby_nice=19), Output(),
                        snapshots.SnapshotDir(), lambda *a: {})
seen = {}
for nice in (19, 0):
    pool.set_nice(child.pid, nice)
    deadline = time.monotonic() + 10
    while pool.renice and time.monotonic() < deadline:
        time.sleep(0.02)
        pool.retry_renice()
    seen[nice] = open(f"/proc/{child.pid}/autogroup").read().split()[-1]
def undo(lower, restore):
    lower()
    try:
        restore()
        return "undone"
    except OSError as error:
        return type(error).__name__
seen["nice"] = undo(lambda: os.setpriority(os.PRIO_PROCESS, child.pid, 19),
                    lambda: os.setpriority(os.PRIO_PROCESS, child.pid, 0))
seen["idle"] = undo(lambda: os.sched_setscheduler(child.pid, os.SCHED_IDLE, os.sched_param(0)),
                    lambda: os.sched_setscheduler(child.pid, os.SCHED_OTHER, os.sched_param(0)))
child.kill()
child.wait()
print(json.dumps({"uid": os.geteuid(), **seen}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv") or not os.path.exists("/proc/self/autogroup"),
    reason="needs root (to become uid nobody with setpriv) and autogroups",
)
def test_an_unprivileged_launcher_lowers_a_spare_s_autogroup_and_raises_it_again_where_nice_cannot():
    """As uid nobody with RLIMIT_NICE 0 (no capabilities): the pool's autogroup nice goes to 19 and back to 0 (the
    second write is refused with EAGAIN within 100 ms of the first and retried), while a nice value or SCHED_IDLE,
    once set, cannot be undone: the reason standby processes are lowered through their autogroup only."""
    python = next((p for p in ("/usr/bin/python3", sys.executable) if os.path.exists(p)), sys.executable)
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
         python, "-c", UNPRIVILEGED, str(multiprocess.ROOT)],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"uid": 65534, "19": "19", "0": "0", "nice": "PermissionError", "idle": "PermissionError"}, seen


SLOW_STANDBY = str(multiprocess.WORKERS / "slow_standby.py")


def test_a_failure_while_the_standby_processes_still_prepare_waits_for_them_rather_than_start_anew(tmp_path):
    """Attempt 1's standby processes joined their group and take 6 s more before they stand by (a long compile);
    process 1 of attempt 0 dies meanwhile. The launcher sees the failure at once, waits for them and wakes them: no
    process started anew. Red with the wait removed ("0 of 2 standby process(es) stood by at the failure", the
    attempt started anew), and with the launcher's socket to a standby process left with a timeout (each poll of
    it blocked: the failure seen only once they stood by, no wait said)."""
    done = multiprocess.launch("-n", "2", "--max-restarts", "1", "--peer-timeout", "15", SLOW_STANDBY, str(tmp_path),
                               timeout=240)  # fmt: skip
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown
    assert "2 standby process(es) of attempt 1 still preparing: waiting for them" in done.stderr, shown
    assert WOKEN.search(done.stderr), shown
    assert "stood by at the failure" not in shown and "starting the processes anew" not in shown, shown
    running = sorted(line for line in done.stdout.splitlines() if "RUNNING attempt 1" in line)
    assert running == [f"[{p}] RUNNING attempt 1 process {p} woken True" for p in (0, 1)], shown
