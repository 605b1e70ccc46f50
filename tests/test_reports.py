"""The launchers' reports (``jddp.cli.reports``): strict parsing, the server's bookkeeping, the report port's
address. The launchers exchanging them for real are in ``tests/test_launch.py`` (two launchers on loopback)."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

import pytest

from jddp import net
from jddp.cli import launch as launch_lib
from jddp.cli import reports
from tests import multiprocess

TOKEN = b"the job token of these tests: 42"


def answer_line(s: socket.socket, raw: bytes) -> bytes:
    """``raw`` (a report's JSON, with or without its newline) as the line that answers the challenge ``s`` got:
    signed with ``TOKEN`` (``reports.signed``), its newline kept or dropped as in ``raw``."""
    data = b""
    while b"\n" not in data:
        data += s.recv(4096)
    nonce = bytes.fromhex(json.loads(data.split(b"\n")[0])["nonce"])
    line = reports.signed(json.loads(raw), TOKEN, nonce)
    return line if raw.endswith(b"\n") else line.rstrip(b"\n")


def test_reports_between_launchers_are_parsed_strictly():
    good = {"node": 1, "attempt": 0, "code": -9, "what": "process 1 killed by SIGKILL"}
    assert reports.parse(json.dumps(good).encode() + b"\n", 2) == reports.Report(1, 0, -9, good["what"])
    bad = [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 0, 9]",
        json.dumps({**good, "node": 0}).encode(),  # node 0 does not report to itself
        json.dumps({**good, "node": 2}).encode(),  # out of --nnodes
        json.dumps({**good, "node": True}).encode(),
        json.dumps({**good, "attempt": -1}).encode(),
        json.dumps({**good, "code": "9"}).encode(),
        json.dumps({**good, "what": None}).encode(),
        json.dumps({k: v for k, v in good.items() if k != "code"}).encode(),
    ]
    for data in bad:
        assert reports.parse(data, 2) is None, data


def test_a_report_carries_the_processes_found_silent_there():
    """Node 0's launcher SIGKILLs at once a process of its own that a survivor on another node found silent: the
    report says which (a list of process indices), and anything else there refuses the whole report."""
    good = {"node": 1, "attempt": 0, "code": 69, "what": "process 1 stopped after losing a peer (exit 69)"}
    line = json.dumps({**good, "silent": [0, 2]}).encode() + b"\n"
    assert reports.parse(line, 2) == reports.Report(1, 0, 69, good["what"], (0, 2))
    assert reports.parse(json.dumps(good).encode(), 2) == reports.Report(1, 0, 69, good["what"], ())
    for silent in ("0", [0.0], [-1], [True], None, {"0": 1}):
        assert reports.parse(json.dumps({**good, "silent": silent}).encode(), 2) is None, silent
    sent = json.loads(json.dumps(dataclasses.asdict(reports.Report(1, 0, 69, "x", (0,)))))
    assert sent["silent"] == [0] and reports.parse(json.dumps(sent).encode(), 2) == reports.Report(1, 0, 69, "x", (0,))


def test_report_server_keeps_the_first_report_of_each_node_per_attempt():
    port = net.free_port()
    server = reports.ReportServer("127.0.0.1", port, nnodes=3, token=TOKEN)
    try:
        to = ("127.0.0.1", port)
        assert reports.send(to, reports.Report(2, 0, 69, "process 5 stopped after losing a peer (exit 69)"), TOKEN)
        assert reports.send(to, reports.Report(1, 0, -9, "process 3 killed by SIGKILL"), TOKEN)
        assert reports.send(to, reports.Report(1, 0, 1, "a later one"), TOKEN)
        assert reports.send(to, reports.Report(1, 1, 3, "the next attempt"), TOKEN)
        with socket.create_connection(to) as junk:
            junk.sendall(b"GET / HTTP/1.0\r\n\r\n")
        with socket.create_connection(to) as big:
            big.sendall(b"x" * (reports.MAX_REPORT_BYTES + 10))
        deadline = time.monotonic() + 10
        while len(server.reports(0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert [(r.node, r.code) for r in server.reports(0)] == [(1, -9), (2, 69)]
        assert [(r.node, r.code) for r in server.reports(1)] == [(1, 3)]
        assert server.reports(2) == []
        with pytest.raises(OSError, match=rf"127\.0\.0\.1:{port}.*already in use.*--coordinator port whose next"):
            reports.ReportServer("127.0.0.1", port, nnodes=2, token=TOKEN)
    finally:
        server.close()
    assert not reports.send(("127.0.0.1", port), reports.Report(1, 0, 1, "nobody listens"), TOKEN)


def test_the_coordinator_port_leaves_room_for_the_report_port():
    with pytest.raises(ValueError, match=r"--coordinator 10\.0\.0\.1:65535: .*port \+ 1"):
        launch_lib.LaunchConfig(target="train", module=True, nnodes=2, coordinator="10.0.0.1:65535")
    launch_lib.LaunchConfig(target="train", module=True, coordinator="10.0.0.1:65535")  # one node: no report port


def wait_for(server: reports.ReportServer, attempt: int, count: int, within_s: float) -> list[reports.Report]:
    deadline = time.monotonic() + within_s
    while len(server.reports(attempt)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return server.reports(attempt)


def report_line(node: int, attempt: int, size: int | None = None) -> bytes:
    """A report of ``node`` for ``attempt`` as one line, padded to ``size`` bytes (newline included) if given."""
    line = json.dumps({"node": node, "attempt": attempt, "code": 69, "what": ""}).encode() + b"\n"
    if size is not None:
        pad = size - len(line)
        line = json.dumps({"node": node, "attempt": attempt, "code": 69, "what": "x" * pad}).encode() + b"\n"
        assert len(line) == size
    return line


def test_a_report_is_read_to_its_end_however_the_client_sends_it(monkeypatch):
    """Whether the sender closes without a newline, keeps the connection open after its line, or stalls in the
    middle of it: the report is read as soon as it is whole (at the newline, at the close, or at the read
    timeout), and a report over ``MAX_REPORT_BYTES`` is ignored even when it is valid JSON."""
    monkeypatch.setattr(reports, "READ_TIMEOUT_S", 30.0)
    port = net.free_port()
    server = reports.ReportServer("127.0.0.1", port, nnodes=8, token=TOKEN)
    to = ("127.0.0.1", port)
    held = []
    try:
        with socket.create_connection(to) as s:  # no newline, then closed
            s.sendall(answer_line(s, report_line(1, 0).rstrip(b"\n")))
        assert [r.node for r in wait_for(server, 0, 1, 10)] == [1]
        s = socket.create_connection(to)  # a whole line, the connection kept open: read at the newline
        held.append(s)
        s.sendall(answer_line(s, report_line(2, 0)))
        assert [r.node for r in wait_for(server, 0, 2, 5)] == [1, 2]
        with socket.create_connection(to) as s:  # exactly the limit: accepted
            s.sendall(answer_line(s, report_line(3, 0, size=reports.MAX_REPORT_BYTES + 1)))
        with socket.create_connection(to) as s:  # valid, but over the limit: ignored
            s.sendall(answer_line(s, report_line(4, 0, size=reports.MAX_REPORT_BYTES + 10)))
        assert [r.node for r in wait_for(server, 0, 3, 10)] == [1, 2, 3]
        time.sleep(0.3)
        assert [r.node for r in server.reports(0)] == [1, 2, 3]
    finally:
        for s in held:
            s.close()
        server.close()
    server._thread.join(timeout=5)  # closing ends the thread that accepts
    assert not server._thread.is_alive()


def test_a_report_stalled_without_its_newline_is_read_at_the_read_timeout(monkeypatch):
    monkeypatch.setattr(reports, "READ_TIMEOUT_S", 0.3)
    port = net.free_port()
    server = reports.ReportServer("127.0.0.1", port, nnodes=2, token=TOKEN)
    try:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(answer_line(s, report_line(1, 0).rstrip(b"\n")))  # and nothing more, the connection open
            assert [r.node for r in wait_for(server, 0, 1, 10)] == [1]
    finally:
        server.close()


def test_the_report_that_arrived_first_is_kept_even_when_it_is_read_last():
    """Each connection is read in a thread of its own, and the threads end in any order (under load, a later
    connection's often first): which report of a node came first is the order the connections arrived in."""
    port = net.free_port()
    server = reports.ReportServer("127.0.0.1", port, nnodes=2, token=TOKEN)
    to = ("127.0.0.1", port)
    try:
        first = reports.Report(1, 0, -9, "process 1 killed by SIGKILL")
        with socket.create_connection(to) as slow:
            line = answer_line(slow, json.dumps(dataclasses.asdict(first)).encode() + b"\n")
            slow.sendall(line[:10])  # arrives first, but its line is not whole yet
            time.sleep(0.2)
            assert reports.send(to, reports.Report(1, 0, 69, "a later report of the same node"), TOKEN)
            assert [r.code for r in wait_for(server, 0, 1, 10)] == [69]
            slow.sendall(line[10:])
            deadline = time.monotonic() + 10
            while server.reports(0)[0].code != -9 and time.monotonic() < deadline:
                time.sleep(0.02)
        assert server.reports(0) == [first]
    finally:
        server.close()


@pytest.mark.skipif(not multiprocess.ipv6_loopback(), reason="no IPv6 loopback here")
def test_reports_travel_over_ipv6_loopback():
    port = net.free_port("::1")
    server = reports.ReportServer(*reports.address(net.split_address(f"[::1]:{port - 1}")), nnodes=2, token=TOKEN)
    try:
        assert reports.send(("::1", port), reports.Report(1, 0, 3, "process 1 exited with code 3"), TOKEN)
        assert [(r.node, r.code) for r in wait_for(server, 0, 1, 10)] == [(1, 3)]
    finally:
        server.close()
