"""Elastic membership (``jddp launch --nnodes MIN:MAX``): the rendezvous where the launchers agree on each round's
nodes.

Where it runs: in node 0's launcher, on the coordinator's host at the coordinator's port + 1 (the address where the
launchers of a fixed membership send their reports, ``jddp.cli.reports``). The first launcher started on that host
binds the address and is node 0 of every round while it runs; every other launcher connects to it and stays connected
for the whole run: the connection is its membership. Node 0 runs the coordination service of every round too; when
it is lost, the first surviving coordinator candidate (``jddp.cli.launch.candidates``) serves this protocol on the
address it reserved, and the others connect there.

The protocol: one JSON object per line, both ways, on that connection.

* A launcher to node 0: ``join`` (first line: its name, its number of processes and its ``candidate`` address, where
  it would host the rendezvous after node 0's loss); ``ready`` (it waits for round
  ``round``: its processes of the round before have ended); ``beat`` (every ``BEAT_S``); ``leave`` (it ends, with
  its exit code). A failure report of a round goes as in a fixed membership, on a connection of its own
  (``jddp.cli.reports.send``): the server takes those too.
* Node 0 to a launcher: ``round`` (start your processes: this round's node rank, number of nodes, first process id,
  number of processes, the round's ``coordinator`` and the ordered coordinator ``candidates``); ``candidates`` (the
  same list, to a launcher waiting to be admitted); ``stop`` (end this round's processes now: the round is over);
  ``end`` (the run is over: exit with ``code``, saying ``why``); ``beat``.

A launcher whose connection closes, or that sends nothing for the peer timeout, is gone: node 0 ends the round at
once and forms the next without it. A launcher that finds node 0 gone (the same two ways) stops its processes and
exits, naming it, or succeeds it (``jddp.cli.launch.member``).

Only the job's own launchers: node 0 sends every connection a challenge first, and its first line (a ``join`` or a
report) must prove the job token (``jddp.cli.reports.signed``, ``jddp.cli.job_token``); node 0 answers ``ok``, or
``refused`` and names the address (the refused launcher exits 1 saying how to fix it). Anything that does not parse
is ignored; a connection that does not start with a proven ``join`` or report is closed. JAX's coordination service
is not covered: see ``jddp.cli.job_token``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import json
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from jddp.cli import job_token, reports

BEAT_S = 1.0  # both ways: what keeps a quiet connection known alive
MAX_LINE_BYTES = 65536
CONNECT_RETRY_S = 0.2


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode() + b"\n"


def send(connection: socket.socket, lock: threading.Lock, message: dict[str, Any]) -> bool:
    """Writes ``message`` as one line (whole: ``lock`` keeps other threads' lines out of it); False once the
    connection is broken."""
    with lock:
        try:
            connection.sendall(encode(message))
            return True
        except OSError:
            return False


@dataclasses.dataclass
class Member:
    """A launcher other than node 0, as node 0 sees it."""

    key: int  # in the order of joining, from 1
    name: str  # what it said it is (its host and pid)
    nprocs: int
    connection: socket.socket
    ready: int = -1  # the round it waits for (-1: none yet)
    heard_at: float = 0.0  # monotonic time of its last line
    gone: str | None = None  # why it is no longer a member (None: it is)
    failures: int = 0  # rounds that failed first on this node (its restarts used)
    finished: bool = False  # its processes finished the run (exit 0): it left, not lost
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    candidate: str | None = None  # where it would host the rendezvous after node 0's loss (jddp.cli.launch.candidates)

    def send(self, message: dict[str, Any]) -> bool:
        return send(self.connection, self.lock, message)


class Server:
    """Node 0's end: accepts launchers (``members``) and failure reports on ``host:port`` until ``close``."""

    def __init__(
        self,
        host: str,
        port: int,
        silence_s: float,
        token: bytes,
        say: Callable[[str], None] | None = None,
        *,
        listener: socket.socket | None = None,
    ) -> None:
        """``listener``: a socket bound to ``host:port`` and listening already (a coordinator candidate's, reserved
        from its start: ``jddp.cli.launch.candidates``), served instead of binding one.

        Raises:
        OSError: the address cannot be listened on (``errno`` EADDRINUSE or EADDRNOTAVAIL: another launcher has
        it, or it is not an address of this host)."""
        self.silence_s, self.token, self.say = silence_s, token, say
        self.members: dict[int, Member] = {}
        self.changed = threading.Condition()
        self._reports: list[tuple[int, reports.Report]] = []
        self._keys = itertools.count(1)
        if listener is not None:
            self._socket = listener
        else:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._socket = socket.socket(family, socket.SOCK_STREAM)
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                self._socket.bind((host, port))
            except OSError:
                self._socket.close()
                raise
            self._socket.listen(256)
        self._closed = False
        threading.Thread(target=self._serve, name="jddp-rendezvous", daemon=True).start()
        threading.Thread(target=self._beat, name="jddp-rendezvous-beat", daemon=True).start()

    # -- the threads ----------------------------------------------------------
    def _serve(self) -> None:
        for arrival in itertools.count():
            try:
                connection, peer = self._socket.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._read, args=(connection, peer, arrival), daemon=True).start()

    def _read(self, connection: socket.socket, peer: Any, arrival: int) -> None:
        connection.settimeout(reports.READ_TIMEOUT_S)
        try:
            nonce = reports.challenge(connection)
        except OSError:
            connection.close()
            return
        lines = reports.lines(connection)
        first = next(lines, None)
        message = reports.opened(first, self.token, nonce)
        if message is None:  # without the job's token: refused and named (a bare probe that sent nothing is not)
            if first is not None:
                reports.refuse(connection, peer, self.say)
            connection.close()
            return
        if message.get("op") != "join":  # a failure report (jddp.cli.reports), or nothing
            report = reports.parse(message, 1 << 30)
            if report is not None:
                with self.changed:
                    self._reports.append((arrival, report))
                    self.changed.notify_all()
            with contextlib.suppress(OSError):
                connection.sendall(reports.encode({"op": "ok"}))
            connection.close()
            return
        nprocs, name = message.get("nprocs"), message.get("name")
        if not (isinstance(nprocs, int) and not isinstance(nprocs, bool) and nprocs >= 1 and isinstance(name, str)):
            connection.close()
            return
        connection.settimeout(None)
        now = time.monotonic()
        candidate = message.get("candidate")
        candidate = candidate[:300] if isinstance(candidate, str) else None
        member = Member(next(self._keys), name[:200], nprocs, connection, heard_at=now, candidate=candidate)
        member.send({"op": "ok"})
        with self.changed:
            self.members[member.key] = member
            self.changed.notify_all()
        for message in lines:
            with self.changed:
                member.heard_at = time.monotonic()
                op = message.get("op")
                if op == "ready" and isinstance(message.get("round"), int):
                    member.ready = message["round"]
                elif op == "leave":
                    member.finished = message.get("code") == 0
                    member.gone = member.gone or f"its launcher ended ({message.get('why', 'no reason given')})"
                self.changed.notify_all()
        with self.changed:
            member.gone = member.gone or "its launcher is gone (its connection closed)"
            self.changed.notify_all()
        with contextlib.suppress(OSError):
            connection.close()

    def _beat(self) -> None:
        while not self._closed:
            time.sleep(BEAT_S)
            now = time.monotonic()
            with self.changed:
                current = [m for m in self.members.values() if m.gone is None]
                for m in current:
                    if now - m.heard_at > self.silence_s:
                        m.gone = f"its launcher has been silent for {self.silence_s:g} s"
                        with contextlib.suppress(OSError):
                            m.connection.shutdown(socket.SHUT_RDWR)
                self.changed.notify_all()
            for m in current:
                m.send({"op": "beat"})

    # -- what node 0 reads and says ---------------------------------------------
    def alive(self) -> list[Member]:
        """The members still connected, in the order they joined."""
        with self.changed:
            return [m for m in sorted(self.members.values(), key=lambda m: m.key) if m.gone is None]

    def wait(self, timeout: float) -> None:
        """Sleeps until something changes (a join, a line, a loss) or ``timeout`` passes."""
        with self.changed:
            self.changed.wait(timeout)

    def reports(self, attempt: int) -> list[reports.Report]:
        """The failure reports received about round ``attempt``, one per node (the first it sent)."""
        with self.changed:
            seen: dict[int, reports.Report] = {}
            for _, r in sorted(self._reports, key=lambda pair: pair[0]):
                if r.attempt == attempt:
                    seen.setdefault(r.node, r)
            return sorted(seen.values(), key=lambda r: r.node)

    def drop(self, member: Member, why: str, code: int) -> None:
        """Ends ``member``'s part in the run: it is told to exit with ``code``."""
        member.send({"op": "end", "code": code, "why": why})
        with self.changed:
            member.gone = member.gone or why
            self.changed.notify_all()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        for m in list(self.members.values()):
            with contextlib.suppress(OSError):
                m.connection.close()


def bind_or_none(
    host: str, port: int, silence_s: float, token: bytes, say: Callable[[str], None] | None = None
) -> Server | None:
    """The server when this launcher can host it (the address is free here), None when another launcher hosts it
    or the address is another host's.

    Raises:
      OSError: the address cannot be bound for another reason.
    """
    try:
        return Server(host, port, silence_s, token, say)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        raise


class Client:
    """A launcher other than node 0: its connection to node 0's rendezvous, read by a thread into ``inbox``."""

    def __init__(
        self,
        address: tuple[str, int],
        name: str,
        nprocs: int,
        timeout: float,
        silence_s: float,
        token: bytes,
        *,
        candidate: str | None = None,
        retry_refused: bool = True,
    ) -> None:
        """Joins with the job's ``token``, retrying until ``timeout`` (node 0's launcher may start later), saying
        ``candidate``, the address where this launcher would host the rendezvous after node 0's loss. Without
        ``retry_refused`` a refused connection ends the tries at once (a coordinator candidate that is gone).

        Raises:
          reports.Refused: node 0's rendezvous refused this launcher's job token.
          OSError: node 0's rendezvous did not answer within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        join: dict[str, Any] = {"op": "join", "name": name, "nprocs": nprocs}
        if candidate is not None:
            join["candidate"] = candidate
        while True:
            try:
                self.connection = socket.create_connection(address, timeout=reports.SEND_TIMEOUT_S)
                # A loaded rendezvous may answer late: its answer is awaited until the join's deadline, and no answer
                # is no refusal (only an explicit one is: a slow successor of node 0 must not be passed over).
                self.connection.settimeout(max(reports.SEND_TIMEOUT_S, deadline - time.monotonic()))
                incoming = reports.answer(self.connection, join, token)
                reply = next(incoming, None)
                if reply is None:
                    raise OSError(errno.ETIMEDOUT, "the rendezvous accepted the connection but did not answer the join")
                break
            except OSError as e:
                with contextlib.suppress(AttributeError, OSError):
                    self.connection.close()
                if not retry_refused and e.errno == errno.ECONNREFUSED:
                    raise
                if time.monotonic() > deadline:
                    host, port = address
                    raise OSError(
                        e.errno,
                        f"no rendezvous answered at {host}:{port} (the --coordinator's port + 1) within "
                        f"--join-timeout={timeout:g} s: start the launcher on the coordinator's host (it hosts the "
                        "rendezvous), or check the address and that the port is reachable",
                    ) from None
                time.sleep(CONNECT_RETRY_S)
        if reply is None or reply.get("op") != "ok":
            self.connection.close()
            host, port = address
            raise reports.Refused(
                f"node 0's rendezvous at {host}:{port} refused this launcher: its job token differs from the run's. "
                f"{job_token.FIX}."
            )
        self.connection.settimeout(None)
        self.silence_s = silence_s
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self.heard_at = time.monotonic()
        self.closed = threading.Event()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(incoming,), name="jddp-rendezvous-client", daemon=True).start()
        threading.Thread(target=self._beat, name="jddp-rendezvous-beat", daemon=True).start()

    def _read(self, incoming) -> None:
        for message in incoming:
            self.heard_at = time.monotonic()
            if message.get("op") != "beat":
                self.inbox.put(message)
        self.closed.set()

    def _beat(self) -> None:
        while not self.closed.wait(BEAT_S):
            self.send({"op": "beat"})

    def send(self, message: dict[str, Any]) -> bool:
        return send(self.connection, self._lock, message)

    def gone(self) -> str | None:
        """Why node 0's rendezvous is gone, or None while it answers."""
        if self.closed.is_set():
            return "its connection closed"
        if time.monotonic() - self.heard_at > self.silence_s:
            return f"it has been silent for {self.silence_s:g} s"
        return None

    def next_message(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)
        self.connection.close()
