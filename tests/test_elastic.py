"""Elastic membership (``jddp launch --nnodes MIN:MAX``) on loopback: three launchers on one machine, one per
"host", each with one process of one device. A host is lost by SIGKILLing its launcher (its processes see it gone);
it comes back as a new launcher. The training must be the run that never lost a host: the global batches do not
depend on the number of processes, and every round resumes from the newest checkpoint, so the losses of every step
and the final parameters equal those of one process that trained alone, to float round-off."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jddp import exitcodes, goodput, net
from tests import multiprocess

FIT_TRAIN = str(multiprocess.WORKERS / "fit_train.py")
PEER_TIMEOUT = 10.0
# Global batches that 3 and 2 devices do not divide, split into micro-batches of at most 8 rows per device: the
# loader pads them and accumulates (3 devices: 1 micro-batch of 7 rows each, 1 padded; 2: 2 of 5; alone: 3 of 7, 1
# padded), so the three layouts of this run compute each step differently and must still agree.
BATCHES = {"TRAIN_BATCH": "20", "EVAL_BATCH": "16", "PER_DEVICE_LIMIT": "8"}
pytestmark = pytest.mark.multiprocess


class Launcher:
    """One ``jddp launch --nnodes 2:3`` (or ``nnodes``) of ``fit_train.py``, its output in files; ``flags``:
    more of the launcher's, ``env``: its processes' own settings (``KILL_AT``, ...)."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        port: int,
        out: Path,
        steps: int,
        step_sleep: float | str,
        nnodes: str = "2:3",
        flags: tuple[str, ...] = (),
        **env: str,
    ) -> None:
        self.log = tmp / f"launcher-{name}.txt"
        argv = [
            sys.executable, "-m", "jddp.launch", "--nnodes", nnodes, "--coordinator", f"127.0.0.1:{port}", "-n", "1",
            "--devices-per-process", "1", "--join-wait", "3", "--peer-timeout", str(PEER_TIMEOUT), "--kill-grace", "1",
            *flags, FIT_TRAIN, str(out), str(steps),
        ]  # fmt: skip
        env = multiprocess.environment(STEP_SLEEP=str(step_sleep), **BATCHES, **env)
        with open(self.log, "wb") as f:
            self.popen = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=multiprocess.ROOT)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def descendants(self) -> set[int]:
        """Its processes' pids, and theirs (Linux's /proc children lists)."""
        return multiprocess.descendants(self.popen.pid)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            raise AssertionError(f"launcher still running after {timeout} s:\n{self.text()[-4000:]}") from None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def steps_taken(out: Path, rank: int) -> list[tuple[int, int]]:
    """``(round, step)`` of every step process ``rank`` took (fit_train.py's record)."""
    try:
        text = (out / f"steps{rank}.txt").read_text()
    except OSError:
        return []
    return [tuple(map(int, line.split())) for line in text.splitlines() if len(line.split()) == 2]  # type: ignore[misc]


def until(what, timeout: float, launchers: list[Launcher]) -> float:
    """Waits until ``what()``; returns the time it became true."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            said = "\n".join(f"--- {launcher.log.name}\n{launcher.text()[-3000:]}" for launcher in launchers)
            raise AssertionError(f"waited {timeout} s for {what.__doc__ or what}:\n{said}")
        time.sleep(0.1)
    return time.monotonic()


def train_losses(out: Path) -> dict[int, float]:
    """The train loss logged at each step; a step logged again (after a restart) by its last record."""
    losses = {}
    for line in (out / "log" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("split") == "train":
            losses[int(record["step"])] = record["loss"]
    return losses


def assert_same_run(out: Path, alone: Path) -> None:
    mine, reference = train_losses(out), train_losses(alone)
    assert sorted(mine) == sorted(reference)
    np.testing.assert_allclose([mine[s] for s in sorted(mine)], [reference[s] for s in sorted(mine)], rtol=2e-5)
    with np.load(out / "final.npz") as a, np.load(alone / "final.npz") as b:
        for k in b.files:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-6, err_msg=k)


def assert_restored_from_memory(records: list[dict]) -> None:
    """Round 1's goodput record: restored from the in-memory snapshot of round 0's processes ("peer"), not from the
    disk."""
    first = next(r for r in records if r.get("split") == "goodput" and r["round"] == 1)
    assert goodput.RESTORED_FROM[int(first["restored_from"])] == "peer", first
    print(f"round 1 restored from memory, {int(first.get('recomputed_steps', 0))} step(s) redone")


def test_a_host_lost_then_back_trains_the_run_that_never_lost_it(tmp_path, alone):
    port, out = net.free_port(), tmp_path / "run"
    out.mkdir()
    a = Launcher(tmp_path, "a", port, out, 60, 0.15)
    launchers = [a]
    until(lambda: net.answers("127.0.0.1", port + 1), 60, launchers)  # a hosts the rendezvous: node 0
    b, c = Launcher(tmp_path, "b", port, out, 60, 0.15), Launcher(tmp_path, "c", port, out, 60, 0.15)
    launchers += [b, c]
    try:
        until(lambda: any(s >= 8 for _, s in steps_taken(out, 2)), 180, launchers)
        before = c.descendants()
        assert before, "c's launcher has no processes"
        c.popen.send_signal(signal.SIGKILL)
        lost_at = time.monotonic()
        c.popen.wait(10)
        # Its processes see it gone and lose their peers: none trains on as a member of the group being re-formed.
        until(lambda: not any(alive(p) for p in before), PEER_TIMEOUT + 20, launchers)
        # Round 1: two hosts, resumed from the newest checkpoint; then the host returns and is admitted (round 2).
        resumed_at = until(lambda: any(r == 1 for r, _ in steps_taken(out, 0)), 120, launchers)
        assert not any(r == 1 for r, _ in steps_taken(out, 2))  # process 2 took no step in round 1: two hosts
        c2 = Launcher(tmp_path, "c2", port, out, 60, 0.15)
        launchers.append(c2)
        until(lambda: any(r == 2 for r, _ in steps_taken(out, 2)), 180, launchers)
        codes = [launcher.wait(240) for launcher in (a, b, c2)]
    finally:
        for launcher in launchers:
            if launcher.popen.poll() is None:
                launcher.popen.kill()
    said = a.text()
    assert codes == [0, 0, 0], said[-4000:]
    assert "round 0: 3 node(s), 3 process(es)" in said, said[-4000:]
    assert "round 1: 2 node(s), 2 process(es) (a node lost)" in said, said[-4000:]
    assert "round 2: 3 node(s), 3 process(es) (admitting a node)" in said, said[-4000:]
    assert "membership history: round 0: 3 node(s)" in said
    assert_same_run(out, alone)
    # The goodput ledger records each round's membership.
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    rounds = [(r["round"], r["nodes"], r["processes"]) for r in records if r.get("split") == "goodput"]
    assert rounds == [(0, 3, 3), (1, 2, 2), (2, 3, 3)], rounds
    # Round 1 restored from the snapshots round 0 left on the hosts that stayed (of another process count)
    assert_restored_from_memory(records)
    print(f"from the loss to training again: {resumed_at - lost_at:.1f} s")


def test_below_min_the_run_ends_named_within_the_peer_timeout(tmp_path):
    """Two of ``--nnodes 2:3`` and one lost: node 0's launcher ends the run, exit 69, naming the loss, well within the
    peer timeout + 10 s (it sees the connection close at once). The processes only join and wait: membership is the
    launchers' business, and a run that trains costs this test nothing more to show it."""
    script = tmp_path / "wait.py"
    script.write_text("import time\nimport jddp\njddp.initialize()\nprint('joined', flush=True)\ntime.sleep(600)\n")
    port = net.free_port()
    argv = [
        sys.executable, "-m", "jddp.launch", "--nnodes", "2:3", "--coordinator", f"127.0.0.1:{port}", "-n", "1",
        "--devices-per-process", "1", "--join-wait", "1", "--peer-timeout", str(PEER_TIMEOUT), str(script),
    ]  # fmt: skip
    logs = [tmp_path / f"launcher-{name}.txt" for name in "ab"]
    env = multiprocess.environment()
    with open(logs[0], "wb") as f:
        a = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=multiprocess.ROOT)
    try:
        deadline = time.monotonic() + 60
        while not net.answers("127.0.0.1", port + 1):
            assert time.monotonic() < deadline and a.poll() is None, logs[0].read_text()
            time.sleep(0.1)
        with open(logs[1], "wb") as f:
            b = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=multiprocess.ROOT)
        deadline = time.monotonic() + 120
        while logs[0].read_text().count("joined") + logs[1].read_text().count("joined") < 2:
            assert time.monotonic() < deadline, logs[0].read_text() + logs[1].read_text()
            time.sleep(0.1)
        b.send_signal(signal.SIGKILL)
        lost_at = time.monotonic()
        code = a.wait(PEER_TIMEOUT + 10 + 30)  # the bound is checked below, the wait is generous
        took = time.monotonic() - lost_at
    finally:
        for launcher in (a, *([b] if "b" in locals() else [])):
            if launcher.poll() is None:
                launcher.kill()
    said = logs[0].read_text()
    assert code == exitcodes.EXIT_PEER_LOST, said[-3000:]
    assert "1 node(s) left, below --nnodes MIN=2" in said and "its launcher is gone" in said, said[-3000:]
    assert took < PEER_TIMEOUT + 10, took


class UntilDone:
    """Launchers a, b, c of one elastic run on loopback (``nnodes`` MIN:MAX) of a script that joins, prints
    ``joined`` and waits for ``done``; each launcher's output in ``launcher-<name>.txt``."""

    def __init__(self, tmp_path, nnodes: str) -> None:
        self.done = tmp_path / "done"
        script = tmp_path / "until_done.py"
        script.write_text(
            "import os, time\nimport jddp\njddp.initialize()\nprint('joined', flush=True)\n"
            f"while not os.path.exists({str(self.done)!r}):\n    time.sleep(0.1)\n"
        )
        self.port = net.free_port()
        self.argv = [
            sys.executable, "-m", "jddp.launch", "--nnodes", nnodes, "--coordinator", f"127.0.0.1:{self.port}",
            "-n", "1", "--devices-per-process", "1", "--join-wait", "1", "--peer-timeout", str(PEER_TIMEOUT),
            str(script),
        ]  # fmt: skip
        self.logs = {name: tmp_path / f"launcher-{name}.txt" for name in "abc"}
        self.launchers: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> None:
        with open(self.logs[name], "wb") as f:
            self.launchers[name] = subprocess.Popen(
                self.argv, env=multiprocess.environment(), stdout=f, stderr=subprocess.STDOUT, cwd=multiprocess.ROOT
            )

    def start_node_0(self) -> None:
        """Starts a and waits until it hosts the rendezvous."""
        self.start("a")
        deadline = time.monotonic() + 60
        while not net.answers("127.0.0.1", self.port + 1):
            assert time.monotonic() < deadline and self.launchers["a"].poll() is None, self.logs["a"].read_text()
            time.sleep(0.1)

    def wait_for(self, what: str, names: str, count: int = 1) -> None:
        deadline = time.monotonic() + 120
        while sum(self.logs[n].read_text().count(what) for n in names) < count:
            assert time.monotonic() < deadline, "\n".join(self.logs[n].read_text() for n in names)
            time.sleep(0.1)

    def kill_all(self) -> None:
        for launcher in self.launchers.values():
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(30)


def test_a_launcher_waiting_to_be_admitted_when_the_run_finishes_exits_0(tmp_path):
    """Two of ``--nnodes 2:3`` run; a third joins and waits to be admitted; the run finishes first. The third was
    told 69, "node 0's launcher ended", as for a failure (seen in ``benchmarks/elastic.py``, an admission that came
    too late): a job whose run succeeded then fails under a scheduler. It must exit 0, saying the run finished."""
    run = UntilDone(tmp_path, "2:3")
    try:
        run.start_node_0()
        run.start("b")
        run.wait_for("joined", "ab", 2)  # round 0 runs, on two
        run.start("c")
        run.wait_for("waiting for a round", "c")  # c joined the rendezvous: it waits for the next round
        run.done.touch()  # the run finishes before any admission (a script without fit is admitted after 10 s)
        codes = {name: run.launchers[name].wait(60) for name in "abc"}
    finally:
        run.kill_all()
    said = {name: run.logs[name].read_text() for name in "abc"}
    assert codes == {"a": 0, "b": 0, "c": 0}, said
    assert "node 0 ended the run: the run finished (exit 0)" in said["c"], said["c"]


@pytest.mark.slow
def test_node_0_lost_the_next_candidate_hosts_and_the_run_finishes_on_two(tmp_path, alone):
    """Node 0's launcher (the rendezvous and the coordination service) SIGKILLed mid-run: the first of the others
    in node 0's candidate order hosts round 1's rendezvous and service, the other joins it there with the job's
    token, and the run finishes on two, the run that never lost a node (losses equal to one uninterrupted process).
    Without the candidate list both end with 69 (node 0 was a single point of failure)."""
    port, out = net.free_port(), tmp_path / "run"
    out.mkdir()
    a = Launcher(tmp_path, "a", port, out, 60, 0.15)
    launchers = [a]
    until(lambda: net.answers("127.0.0.1", port + 1), 60, launchers)  # a hosts the rendezvous: node 0
    b, c = Launcher(tmp_path, "b", port, out, 60, 0.15), Launcher(tmp_path, "c", port, out, 60, 0.15)
    launchers += [b, c]
    try:
        until(lambda: any(s >= 8 for _, s in steps_taken(out, 0)), 180, launchers)
        before = a.descendants()
        a.popen.send_signal(signal.SIGKILL)
        lost_at = time.monotonic()
        a.popen.wait(10)
        until(lambda: not any(alive(p) for p in before), 10, launchers)  # jddp.cli.launch.orphans
        resumed_at = until(lambda: any(r == 1 for r, _ in steps_taken(out, 0)), 120, launchers)
        codes = [launcher.wait(240) for launcher in (b, c)]
    finally:
        for launcher in launchers:
            if launcher.popen.poll() is None:
                launcher.popen.kill()
    said = {name: launcher.text() for name, launcher in zip("bc", (b, c), strict=True)}
    assert codes == [0, 0], said
    hosts = [name for name in "bc" if "this launcher is node 0 from round 1 on" in said[name]]
    assert len(hosts) == 1, said
    host, other = said[hosts[0]], said["c" if hosts[0] == "b" else "b"]
    assert "round 1: 2 node(s), 2 process(es) (node 0 lost)" in host, host[-4000:]
    assert "joined the rendezvous of the next node 0" in other, other[-4000:]
    assert "fit: run " in host and "(restarted by jddp launch (restart 1))" in host, host[-4000:]  # the same run
    assert not any(r == 1 for r, _ in steps_taken(out, 2))  # two processes in round 1
    assert_same_run(out, alone)
    records = [json.loads(line) for line in (out / "log" / "metrics.jsonl").read_text().splitlines()]
    rounds = [(r["round"], r["nodes"], r["processes"]) for r in records if r.get("split") == "goodput"]
    assert rounds == [(0, 3, 3), (1, 2, 2)], rounds  # one run: the successor's process 0 accounts for round 0 too
    print(f"node 0 lost: from the loss to training again on two: {resumed_at - lost_at:.1f} s")
    assert_restored_from_memory(records)


def test_a_launcher_waiting_at_max_joins_the_successor_of_a_lost_node_0(tmp_path):
    """``--nnodes 1:2``: a and b run, c waits (the run is at MAX); node 0 (a) is SIGKILLed. c was sent the candidates
    while it waited, so it finds b, which succeeds node 0, and round 1 runs on b and c; the run finishes there.
    Without the candidates sent to a waiting launcher, c exits 69 knowing none, and round 1 runs on b alone."""
    run = UntilDone(tmp_path, "1:2")
    try:
        run.start_node_0()
        run.start("b")
        run.wait_for("joined", "ab", 2)  # round 0 runs on two: MAX
        run.start("c")
        run.wait_for("its successor is the first to answer of:", "c")  # c waits, and knows the candidates
        run.launchers["a"].send_signal(signal.SIGKILL)
        run.launchers["a"].wait(10)
        run.wait_for("joined", "bc", 3)  # round 1: b's process and c's
        run.done.touch()
        codes = {name: run.launchers[name].wait(60) for name in "bc"}
    finally:
        run.kill_all()
    said = {name: run.logs[name].read_text() for name in "bc"}
    assert codes == {"b": 0, "c": 0}, said
    assert "round 1: 2 node(s), 2 process(es) (node 0 lost)" in said["b"], said["b"]
    assert "joined the rendezvous of the next node 0" in said["c"], said["c"]
