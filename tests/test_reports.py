"""The launchers' reports (``jddp.cli.reports``): strict parsing, the server's bookkeeping, the report port's
address. The launchers exchanging them for real are in ``tests/test_launch.py`` (two launchers on loopback)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from jddp import net
from jddp.cli import launch as launch_lib
from jddp.cli import reports


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


def test_report_server_keeps_the_first_report_of_each_node_per_attempt():
    port = net.free_port()
    server = reports.ReportServer("127.0.0.1", port, nnodes=3)
    try:
        to = ("127.0.0.1", port)
        assert reports.send(to, reports.Report(2, 0, 69, "process 5 stopped after losing a peer (exit 69)"))
        assert reports.send(to, reports.Report(1, 0, -9, "process 3 killed by SIGKILL"))
        assert reports.send(to, reports.Report(1, 0, 1, "a later one"))
        assert reports.send(to, reports.Report(1, 1, 3, "the next attempt"))
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
            reports.ReportServer("127.0.0.1", port, nnodes=2)
    finally:
        server.close()
    assert not reports.send(("127.0.0.1", port), reports.Report(1, 0, 1, "nobody listens"))


def test_the_coordinator_port_leaves_room_for_the_report_port():
    with pytest.raises(ValueError, match=r"--coordinator 10\.0\.0\.1:65535: .*port \+ 1"):
        launch_lib.LaunchConfig(target="train", module=True, nnodes=2, coordinator="10.0.0.1:65535")
    launch_lib.LaunchConfig(target="train", module=True, coordinator="10.0.0.1:65535")  # one node: no report port
