"""Between the launchers of a run over several nodes: the other nodes tell node 0's launcher how their group ended.

A launcher sees only its own node's processes. Node 0's launcher learns that
the group failed elsewhere only if one of its own processes notices, and a
process frozen there (SIGSTOP, C code holding the GIL) never does. Nodes other
than 0 have the opposite view for free: they watch node 0's coordination
service, which goes away when node 0's launcher ends the attempt. torchrun
covers both ways with its rendezvous store, which every agent reads.

jddp keeps it as small: node 0's launcher listens on the coordinator's host at
the coordinator's port + 1 (``ReportServer``) for the whole run, and the
launcher of any other node, when an attempt of its own fails, sends one line of
JSON there (``send``): its node rank, the attempt, and what failed first.
Node 0's launcher then gives its own processes a few seconds to end by
themselves and stops those that do not, as it does after a lost peer of its own
(``jddp.cli.launch``); after a failure of its own, it stops keeping the
service up for the others once every other node has reported.

Reports are advice, never a command to trust blindly: one that does not parse,
names a node out of range or an attempt other than the current one is ignored.
Like JAX's coordination service, the port is unauthenticated: it belongs on the
cluster's private network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import socket
import threading
from typing import TypeGuard

PORT_OFFSET = 1  # the report port is the coordinator's port + 1
MAX_REPORT_BYTES = 4096
READ_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Report:
    """What another node's launcher said: its attempt ``attempt`` failed, first with exit code ``code`` (negative: the
    signal), described by ``what``."""

    node: int
    attempt: int
    code: int
    what: str
    silent: tuple[int, ...] = ()  # processes (of any node) that a process there found silent: stopped at once


def address(coordinator: tuple[str, int]) -> tuple[str, int]:
    """The report address that belongs to the coordinator address ``(host, port)``."""
    host, port = coordinator
    return host, port + PORT_OFFSET


def parse(data: bytes, nnodes: int) -> Report | None:
    """The report in ``data`` (one JSON object), or None if it is not one from a node of ``nnodes`` other than 0."""
    try:
        obj = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(obj, dict):
        return None
    node, attempt, code, what = (obj.get(k) for k in ("node", "attempt", "code", "what"))
    if not (_is_int(node) and _is_int(attempt) and _is_int(code) and isinstance(what, str)):
        return None
    if not 0 < node < nnodes or attempt < 0:
        return None
    silent = obj.get("silent", [])
    if not (isinstance(silent, list) and all(_is_int(p) and p >= 0 for p in silent)):
        return None
    return Report(node, attempt, code, what[:500], tuple(silent[:1024]))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class ReportServer:
    """Node 0's end: accepts reports on ``host:port`` in a thread of its own until ``close``."""

    def __init__(self, host: str, port: int, nnodes: int) -> None:
        """Raises:
        OSError: the address cannot be listened on (naming it and the fix)."""
        self.nnodes = nnodes
        self._reports: list[tuple[int, Report]] = []  # (order of arrival, report)
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as e:
            self._socket.close()
            taken = " is already in use by another program" if e.errno == errno.EADDRINUSE else f": {e.strerror}"
            raise OSError(
                e.errno,
                f"Node 0's launcher listens for the other nodes' launchers at the coordinator's port + 1, "
                f"{host}:{port}, and that address{taken}. Pick a --coordinator port whose next port is free too.",
            ) from None
        self._socket.listen(64)
        self._thread = threading.Thread(target=self._serve, name="jddp-reports", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # Connections are numbered as they are accepted (the kernel's accept queue keeps the order they arrived in);
        # their reading threads can end in any order, and the number, not that order, says which report came first.
        for arrival in itertools.count():
            try:
                connection, _ = self._socket.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._read, args=(connection, arrival), daemon=True).start()

    def _read(self, connection: socket.socket, arrival: int) -> None:
        with connection:
            connection.settimeout(READ_TIMEOUT_S)
            data = b""
            with contextlib.suppress(OSError):
                while len(data) <= MAX_REPORT_BYTES and not data.endswith(b"\n"):
                    chunk = connection.recv(MAX_REPORT_BYTES)
                    if not chunk:
                        break
                    data += chunk
        report = parse(data, self.nnodes) if len(data) <= MAX_REPORT_BYTES else None
        if report is not None:
            with self._lock:
                self._reports.append((arrival, report))

    def reports(self, attempt: int) -> list[Report]:
        """The reports received so far about ``attempt``, one per node (the first it sent)."""
        with self._lock:
            seen: dict[int, Report] = {}
            for _, r in sorted(self._reports, key=lambda pair: pair[0]):
                if r.attempt == attempt:
                    seen.setdefault(r.node, r)
            return sorted(seen.values(), key=lambda r: r.node)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def send(to: tuple[str, int], report: Report, timeout_s: float = SEND_TIMEOUT_S) -> bool:
    """Sends ``report`` to node 0's launcher at ``to``; returns whether it was delivered (False when node 0's launcher
    is gone or unreachable: then there is no one left to tell)."""
    line = json.dumps(dataclasses.asdict(report)).encode() + b"\n"
    try:
        with socket.create_connection(to, timeout=timeout_s) as s:
            s.sendall(line)
        return True
    except OSError:
        return False
