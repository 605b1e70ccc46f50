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

Only the job's own launchers are heard (``jddp.cli.job_token``): node 0 answers
every connection with a challenge, and its first line must carry the HMAC of the
challenge and the line under the job token (``signed``, ``opened``); anything
else is refused (``{"op": "refused"}``) and named by its address.

Node 0 also talks back: each other launcher opens one connection at its start
(``Subscription``: a ``hello``, which a launcher with another token is refused at,
before it starts anything) and keeps it for the run. On it node 0's launcher
says which processes of that node a process of node 0 found silent
(``{"op": "silent", "attempt": A, "processes": [...]}``), so that their launcher
stops them at once: a process frozen there would otherwise be stopped only once
its launcher saw node 0's coordination service gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeGuard

from jddp.cli import job_token

PORT_OFFSET = 1  # the report port is the coordinator's port + 1
MAX_REPORT_BYTES = 4096
READ_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 2.0
CONNECT_RETRY_S = 0.2
MAX_LINE_BYTES = 65536


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


def parse(data: bytes | dict, nnodes: int) -> Report | None:
    """The report in ``data`` (one JSON object, or its dict), or None if it is not one from a node of ``nnodes``
    other than 0."""
    try:
        obj = json.loads(data.decode()) if isinstance(data, bytes) else data
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


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def lines(connection: socket.socket, first: bytes = b"") -> Iterator[dict[str, Any]]:
    """The JSON objects of the lines that arrive on ``connection`` until it closes (or sends garbage)."""
    buffer = first
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            try:
                message = json.loads(line.decode())
            except (UnicodeDecodeError, ValueError):
                return
            if not isinstance(message, dict):
                return
            yield message
        if len(buffer) > MAX_LINE_BYTES:
            return
        try:
            chunk = connection.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:  # closed, or silent for the read timeout: a last line without its newline still counts
            with contextlib.suppress(UnicodeDecodeError, ValueError):
                message = json.loads(buffer.decode()) if buffer.strip() else None
                if isinstance(message, dict):
                    yield message
            return
        buffer += chunk


def challenge(connection: socket.socket) -> bytes:
    """Node 0's first line on a connection: a fresh challenge; returns it."""
    nonce = secrets.token_bytes(16)
    connection.sendall(encode({"op": "challenge", "nonce": nonce.hex()}))
    return nonce


def signed(message: dict[str, Any], token: bytes, nonce: bytes) -> bytes:
    """``message`` as the line that answers the challenge ``nonce``: its text and the HMAC of both under ``token``."""
    body = json.dumps(message)
    return encode({"body": body, "mac": job_token.prove(token, nonce, body.encode())})


def opened(line: dict[str, Any] | None, token: bytes, nonce: bytes) -> dict[str, Any] | None:
    """The message of a line that ``signed`` made with ``token`` for ``nonce``, else None."""
    body = line.get("body") if line is not None else None
    if not isinstance(body, str) or line is None or not job_token.verify(token, nonce, body.encode(), line.get("mac")):
        return None
    with contextlib.suppress(ValueError):
        message = json.loads(body)
        if isinstance(message, dict):
            return message
    return None


def refuse(connection: socket.socket, peer: Any, say: Callable[[str], None] | None) -> None:
    """Tells a connection whose first line did not prove the job token that it is refused, and says so here."""
    host, port = (peer[0], peer[1]) if isinstance(peer, tuple) and len(peer) >= 2 else ("?", "?")
    with contextlib.suppress(OSError):
        connection.sendall(encode({"op": "refused", "why": f"{job_token.FIX}."}))
    if say is not None:
        say(
            f"refused a connection from {host}:{port} to the launchers' port: it did not prove this job's token "
            "(another job's launcher, or a stray program); the run goes on without it"
        )


def answer(connection: socket.socket, message: dict[str, Any], token: bytes) -> Iterator[dict[str, Any]]:
    """The client's side of the handshake: reads node 0's challenge, sends ``message`` signed, and returns the
    lines that follow (the first is node 0's ``ok`` or ``refused``)."""
    incoming = lines(connection)
    first = next(incoming, None)
    nonce_hex = first.get("nonce") if first is not None and first.get("op") == "challenge" else None
    try:
        nonce = bytes.fromhex(nonce_hex) if isinstance(nonce_hex, str) else None
    except ValueError:
        nonce = None
    if nonce is None:
        raise OSError("the launchers' port did not send a challenge: it is not a jddp launcher's")
    connection.sendall(signed(message, token, nonce))
    return incoming


class Refused(OSError):
    """Node 0's launcher refused this launcher: its job token differs (the message says how to fix it)."""


class ReportServer:
    """Node 0's end: accepts reports and the other launchers' subscriptions on ``host:port`` in a thread of its own
    until ``close``; ``token`` is the job's (``jddp.cli.job_token``), ``say`` names what it refuses."""

    def __init__(
        self, host: str, port: int, nnodes: int, token: bytes, say: Callable[[str], None] | None = None
    ) -> None:
        """Raises:
        OSError: the address cannot be listened on (naming it and the fix)."""
        self.nnodes, self.token, self.say = nnodes, token, say
        self._reports: list[tuple[int, Report]] = []  # (order of arrival, report)
        self._lock = threading.Lock()
        self._subscribers: dict[int, tuple[socket.socket, threading.Lock]] = {}  # node -> its connection
        self._silent: dict[int, set[int]] = {}  # attempt -> processes found silent, as told
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
                connection, peer = self._socket.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._read, args=(connection, peer, arrival), daemon=True).start()

    def _read(self, connection: socket.socket, peer: Any, arrival: int) -> None:
        with connection:
            connection.settimeout(READ_TIMEOUT_S)
            try:
                nonce = challenge(connection)
            except OSError:
                return
            incoming = lines(connection)
            first = next(incoming, None)
            message = opened(first, self.token, nonce)
            if message is not None and first is not None and len(first["body"]) > MAX_REPORT_BYTES:
                return  # a proven report, but longer than any launcher sends
            if message is None:
                if first is not None:  # something answered, without the token: named (a bare probe says nothing)
                    refuse(connection, peer, self.say)
                return
            if message.get("op") == "hello" and _is_int(message.get("node")) and 0 < message["node"] < self.nnodes:
                self._subscribe(connection, message["node"], incoming)
                return
            report = parse(message, self.nnodes)
            if report is not None:
                with self._lock:
                    self._reports.append((arrival, report))
            with contextlib.suppress(OSError):
                connection.sendall(encode({"op": "ok"}))

    def _subscribe(self, connection: socket.socket, node: int, incoming: Iterator[dict[str, Any]]) -> None:
        """Keeps node ``node``'s launcher's connection for the run: node 0's word goes there (``tell_silent``)."""
        lock = threading.Lock()
        with self._lock:
            self._subscribers[node] = (connection, lock)
            told = sorted(self._silent.items())
        with lock, contextlib.suppress(OSError):
            connection.sendall(encode({"op": "ok"}))
            for attempt, processes in told:
                connection.sendall(encode({"op": "silent", "attempt": attempt, "processes": sorted(processes)}))
        connection.settimeout(None)
        for _ in incoming:  # nothing is expected from it; the loop ends when it closes
            pass
        with self._lock:
            if self._subscribers.get(node, (None,))[0] is connection:
                del self._subscribers[node]

    def tell_silent(self, attempt: int, processes: set[int]) -> None:
        """Tells every other node's launcher that a process of this node found ``processes`` silent in ``attempt``
        (each stops those of its own at once); each process is told once."""
        with self._lock:
            known = self._silent.setdefault(attempt, set())
            new = set(processes) - known
            known |= new
            subscribers = list(self._subscribers.values())
        if not new:
            return
        line = encode({"op": "silent", "attempt": attempt, "processes": sorted(new)})
        for connection, lock in subscribers:
            with lock, contextlib.suppress(OSError):
                connection.sendall(line)

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
        with self._lock:
            subscribers = list(self._subscribers.values())
        for connection, _ in subscribers:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


def send(to: tuple[str, int], report: Report, token: bytes, timeout_s: float = SEND_TIMEOUT_S) -> bool:
    """Sends ``report`` to node 0's launcher at ``to``, signed with the job's ``token``; returns whether it was
    delivered (False when node 0's launcher is gone, unreachable or refused it: then there is no one left to tell)."""
    try:
        with socket.create_connection(to, timeout=timeout_s) as s:
            reply = next(answer(s, dataclasses.asdict(report), token), None)
        return reply is not None and reply.get("op") == "ok"
    except OSError:
        return False


class Subscription:
    """Node ``node``'s end of its connection to node 0's launcher (a ``hello``, kept for the run): what node 0 tells
    this launcher, read by a thread of its own."""

    def __init__(self, to: tuple[str, int], node: int, token: bytes, timeout_s: float) -> None:
        """Connects, retrying until ``timeout_s`` (node 0's launcher may start later).

        Raises:
          Refused: node 0's launcher refused this one's job token.
          OSError: node 0's launcher did not answer within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        host, port = to
        while True:
            try:
                self.connection = socket.create_connection(to, timeout=SEND_TIMEOUT_S)
                incoming = answer(self.connection, {"op": "hello", "node": node}, token)
                reply = next(incoming, None)
                break
            except OSError as e:
                with contextlib.suppress(AttributeError, OSError):
                    self.connection.close()
                if time.monotonic() > deadline:
                    raise OSError(
                        e.errno,
                        f"node 0's launcher did not answer at {host}:{port} (the --coordinator's port + 1) within "
                        f"--join-timeout={timeout_s:g} s: start it, or check the address and that the port is "
                        "reachable",
                    ) from None
                time.sleep(CONNECT_RETRY_S)
        if reply is None or reply.get("op") != "ok":
            self.connection.close()
            raise Refused(
                f"node 0's launcher at {host}:{port} refused this launcher: its job token differs from the run's. "
                f"{job_token.FIX}."
            )
        self.connection.settimeout(None)
        self._silent: dict[int, set[int]] = {}
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(incoming,), name="jddp-reports-subscription", daemon=True).start()

    def _read(self, incoming: Iterator[dict[str, Any]]) -> None:
        for message in incoming:
            processes, attempt = message.get("processes"), message.get("attempt")
            if message.get("op") == "silent" and _is_int(attempt) and isinstance(processes, list):
                with self._lock:
                    self._silent.setdefault(attempt, set()).update(p for p in processes if _is_int(p))

    def silent(self, attempt: int) -> set[int]:
        """The processes node 0 said a process of its found silent in ``attempt``."""
        with self._lock:
            return set(self._silent.get(attempt, ()))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        self.connection.close()
