"""No orphans (``jddp.cli.launch.orphans``): a launcher SIGKILLed mid-run leaves none of the processes it started.

Each test collects every process the launcher started (its workers, spares or standby processes, the coordination
service, the watcher, and their children: Linux's ``/proc`` children lists), SIGKILLs the launcher, and polls until
every one of them has ended, printing the time it took. The bound checked is ``service.SERVICE_GRACE_S`` (10 s): the
fallbacks without the watcher (the service's own grace, a worker watchdog's round) take at least that long, and a
script that never calls ``jddp.initialize`` (the scripts here) is never ended by them at all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jddp import exitcodes, net
from jddp.cli.launch import service
from tests import multiprocess

pytestmark = pytest.mark.multiprocess

UP = "sleeper is up"  # a line no launcher says ("up" alone is in "group", "startup", ...)
SLEEPER = f"import time\nprint({UP!r}, flush=True)\ntime.sleep(600)\n"  # no jddp.initialize: no watchdog ends it


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[:1]
    except OSError:
        return False


def describe(pids: set[int]) -> str:
    lines = []
    for p in sorted(pids):
        try:
            command = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            lines.append(f"{p}: {command[:200]}")
        except OSError:
            lines.append(f"{p}: (gone)")
    return "\n".join(lines)


def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "jddp.launch", *argv],
            env=multiprocess.environment(),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=multiprocess.ROOT,
        )


def wait_for(what: str, log: Path, popen: subprocess.Popen, count: int = 1, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while log.read_text(errors="replace").count(what) < count:
        assert popen.poll() is None and time.monotonic() < deadline, f"no {what!r}:\n{log.read_text()[-4000:]}"
        time.sleep(0.1)


def collect(launcher: subprocess.Popen, at_least: int, log: Path, timeout: float = 30) -> set[int]:
    """Every process ``launcher`` started, once there are ``at_least`` of them (its service and watcher may start
    a moment after its first worker says it is up)."""
    deadline = time.monotonic() + timeout
    while len(started := multiprocess.descendants(launcher.pid)) < at_least:
        said = f"{describe(started)}\n{log.read_text()[-3000:]}"
        assert launcher.poll() is None and time.monotonic() < deadline, said
        time.sleep(0.1)
    return started


def kill_and_time(launcher: subprocess.Popen, started: set[int], log: Path) -> float:
    """SIGKILLs ``launcher``; returns how long until every process of ``started`` had ended (fails past the bound)."""
    assert started, log.read_text()[-4000:]
    os.kill(launcher.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    launcher.wait(10)
    limit = killed_at + service.SERVICE_GRACE_S + 30  # polled generously; the bound is asserted below
    while any(alive(p) for p in started) and time.monotonic() < limit:
        time.sleep(0.05)
    took = time.monotonic() - killed_at
    left = {p for p in started if alive(p)}
    try:
        assert not left and took < service.SERVICE_GRACE_S, (
            f"{took:.1f} s after the launcher's SIGKILL, still running:\n{describe(left)}\n{log.read_text()[-3000:]}"
        )
    finally:
        for p in left:  # what a failing run left: not this test's to leave behind
            try:
                os.killpg(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return took


def test_one_node_launcher_sigkilled_leaves_no_workers_spares_standby_or_service(tmp_path):
    """``-n 2 --max-restarts 1``: two workers, their spares handed their standby roles, the next attempt's
    coordination service and this attempt's; all end within a second or so of the launcher's SIGKILL."""
    script, log = tmp_path / "sleeper.py", tmp_path / "launcher.txt"
    script.write_text(SLEEPER)
    launcher = start(["-n", "2", "--devices-per-process", "1", "--max-restarts", "1", str(script)], log)
    try:
        wait_for(UP, log, launcher, count=2)
        wait_for("spare process(es) ready for a restart", log, launcher)
        time.sleep(1.0)  # the spares are handed their standby roles (a sleeper never stands by: it runs the script)
        started = collect(launcher, 7, log)  # 2 workers, 2 spares, 2 services, the watcher at least
        took = kill_and_time(launcher, started, log)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(30)
    print(f"one node: {len(started)} processes ended {took:.2f} s after the launcher's SIGKILL")


def test_elastic_node_0_sigkilled_leaves_no_workers_or_service(tmp_path):
    """``--nnodes 2:3``: node 0's launcher (the rendezvous, the coordination service) SIGKILLed while round 0 runs;
    its worker, its service and the watcher end at once (the other node ends as its rounds say)."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    port = net.free_port()
    argv = ["--nnodes", "2:3", "--coordinator", f"127.0.0.1:{port}", "-n", "1", "--devices-per-process", "1",
            "--join-wait", "1", "--peer-timeout", "10", str(script)]  # fmt: skip
    logs = [tmp_path / "launcher-a.txt", tmp_path / "launcher-b.txt"]
    a = start(argv, logs[0])
    launchers = [a]
    try:
        deadline = time.monotonic() + 60
        while not net.answers("127.0.0.1", port + 1):
            assert a.poll() is None and time.monotonic() < deadline, logs[0].read_text()
            time.sleep(0.1)
        launchers.append(start(argv, logs[1]))
        wait_for(UP, logs[0], a)
        started = collect(a, 3, logs[0])  # its worker, the service, the watcher
        took = kill_and_time(a, started, logs[0])
        # Node 1, the only candidate left, succeeds node 0 and ends below MIN, naming what was lost.
        assert launchers[1].wait(60) == exitcodes.EXIT_PEER_LOST, logs[1].read_text()[-3000:]
        said = logs[1].read_text()
        assert "this launcher is node 0 from round 1 on" in said, said[-3000:]
        assert "1 node(s) left, below --nnodes MIN=2 (lost: node 0 (127.0.0.1:" in said, said[-3000:]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                left = multiprocess.descendants(launcher.pid)
                launcher.kill()
                for p in left:
                    with_suppressed_kill(p)
            launcher.wait(30)
    print(f"elastic node 0: {len(started)} processes ended {took:.2f} s after its launcher's SIGKILL")


def with_suppressed_kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
