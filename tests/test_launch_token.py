"""The job token (``jddp.cli.job_token``): only the job's own launchers join its rendezvous and send it reports."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from jddp import net
from jddp.cli import job_token, reports
from jddp.cli.launch import rendezvous
from tests import multiprocess

GROUP = str(multiprocess.WORKERS / "group.py")
TOKEN, OTHER = b"the run's own token, 32 chars.." * 2, b"another job's token, 32 chars.." * 2


def test_a_report_or_a_join_with_another_token_is_refused_and_named():
    said: list[str] = []
    port = net.free_port()
    server = reports.ReportServer("127.0.0.1", port, nnodes=2, token=TOKEN, say=said.append)
    to = ("127.0.0.1", port)
    try:
        assert not reports.send(to, reports.Report(1, 0, 3, "a stray report"), OTHER)
        with pytest.raises(reports.Refused, match=r"refused this launcher: its job token differs.*JDDP_JOB_TOKEN"):
            reports.Subscription(to, 1, OTHER, timeout_s=5)
        assert server.reports(0) == []
        deadline = time.monotonic() + 30  # the server names a refusal in its own thread, after the client has read it
        while len(said) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # two refusals at least: a client that could not read its refusal (the server closed first, a reset on a
        # loaded host) connects again and is refused again
        assert len(said) >= 2 and all("refused a connection from 127.0.0.1:" in s for s in said), said
        assert reports.send(to, reports.Report(1, 0, 3, "process 1 exited with code 3"), TOKEN)
        assert [r.code for r in server.reports(0)] == [3]
    finally:
        server.close()
    hosted = rendezvous.Server("127.0.0.1", port, 5.0, TOKEN, said.append)
    try:
        with pytest.raises(reports.Refused, match=r"rendezvous at 127\.0\.0\.1:\d+ refused this launcher"):
            rendezvous.Client(to, "stray:1", 1, 5.0, 5.0, OTHER)
        member = rendezvous.Client(to, "node:2", 1, 5.0, 5.0, TOKEN)
        assert [m.name for m in hosted.alive()] == ["node:2"]
        member.close()
    finally:
        hosted.close()


def test_the_token_never_crosses_the_network_and_each_proof_is_for_its_challenge():
    line = reports.signed({"op": "hello", "node": 1}, TOKEN, b"n" * 16)
    assert TOKEN not in line and TOKEN.hex().encode() not in line
    parsed = json.loads(line)
    assert reports.opened(parsed, TOKEN, b"n" * 16) == {"op": "hello", "node": 1}
    assert reports.opened(parsed, TOKEN, b"m" * 16) is None  # a replay to another challenge
    assert reports.opened(parsed, OTHER, b"n" * 16) is None
    assert reports.opened({**parsed, "body": parsed["body"].replace("1", "2")}, TOKEN, b"n" * 16) is None


@pytest.mark.parametrize(("value", "match"), [("short", r"\$JDDP_JOB_TOKEN holds 5 characters; .*at least 16")])
def test_a_short_token_is_refused_with_the_fix(value, match, monkeypatch):
    monkeypatch.setenv("JDDP_JOB_TOKEN", value)
    with pytest.raises(ValueError, match=match):
        job_token.resolve(nnodes=2, coordinator="127.0.0.1:29500")


def test_a_token_file_others_may_read_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("JDDP_JOB_TOKEN", raising=False)
    path = tmp_path / "token"
    path.write_text("x" * 40 + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"may be read by others \(mode 644\): chmod 600"):
        job_token.resolve(nnodes=2, coordinator=None, token_file=str(path))
    path.chmod(0o600)
    assert job_token.resolve(nnodes=2, coordinator=None, token_file=str(path))[0] == b"x" * 40


def test_derived_tokens_agree_per_job_and_differ_between_jobs(tmp_path, monkeypatch):
    monkeypatch.delenv("JDDP_JOB_TOKEN", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    first, _ = job_token.resolve(nnodes=2, coordinator="10.0.0.1:29500")
    assert job_token.resolve(nnodes=2, coordinator="10.0.0.1:29500")[0] == first  # every node of the job
    assert (tmp_path / "jddp" / "job-secret").stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    assert job_token.resolve(nnodes=2, coordinator="10.0.0.1:29500")[0] != first
    monkeypatch.delenv("SLURM_JOB_ID")
    one, two = (job_token.resolve(nnodes=1, coordinator=None)[0] for _ in range(2))
    assert one != two and len(one) >= job_token.MIN_CHARS  # one node: a fresh token per run


@pytest.mark.multiprocess
def test_a_stray_launcher_with_another_token_is_refused_named_and_the_run_goes_on():
    """Node 0 and node 1 hold the run's token; a third launcher, pointed at the same address as node 1 with another
    job's token, is refused before it starts anything: it exits 1 saying how to fix it, node 0's launcher names its
    address, and the run finishes on both nodes."""
    port = net.free_port()

    def start(rank: int, token: bytes) -> subprocess.Popen:
        argv = ("--nnodes", "2", "--node-rank", str(rank), "--coordinator", f"127.0.0.1:{port}", "--join-timeout", "60")
        return subprocess.Popen(
            [sys.executable, "-m", "jddp.launch", *argv, GROUP, "hello"],
            env=multiprocess.environment(JDDP_JOB_TOKEN=token.decode()),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=multiprocess.ROOT,
        )

    stray = start(1, OTHER)
    launchers = [start(0, TOKEN), start(1, TOKEN)]
    out, err = stray.communicate(timeout=120)
    results = [p.communicate(timeout=240) for p in launchers]
    shown = err[-2000:] + "".join(e[-3000:] for _, e in results)
    assert stray.returncode == 1, shown
    assert "refused this launcher: its job token differs from the run's" in err and "JDDP_JOB_TOKEN" in err, shown
    assert "[" not in out, out  # it started no process
    assert "refused a connection from 127.0.0.1:" in results[0][1], shown
    assert [p.returncode for p in launchers] == [0, 0], shown
