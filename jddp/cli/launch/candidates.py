"""Coordinator candidates of an elastic run: the address each launcher would host the rendezvous at, and the order
in which the survivors of node 0's loss try them.

Node 0 of a round hosts the rendezvous and the coordination service; without a successor its loss ends the run. So
every launcher of ``--nnodes MIN:MAX`` reserves, from its start, the two ports it would need as node 0: ``P`` for the
rendezvous (bound and listening, not yet served) and ``P - 1`` for the coordination service (bound, released right
before the service starts), on the address of this host that reaches the ``--coordinator``'s host. It says the
rendezvous address (its *candidate* address) when it joins; node 0 sends every launcher the ordered list of them
with each round (the round's nodes by node rank, then those waiting to be admitted), and again when a launcher joins
while a round runs.

When node 0's rendezvous is gone (its connection closed, or silent for the peer timeout), each launcher stops its
processes, as for any lost node, and walks the list in order (``succeed``): the first candidate that answers is the
next node 0, and it joins there with the job's token; reaching its own address first, it hosts the rendezvous itself,
on the listening socket it reserved, and the coordination service at ``P - 1``. A candidate that is gone refuses the
connection at once (its socket closed with it); one that is alive but has not yet seen node 0's loss accepts it into
its backlog and answers once it hosts, within ``ANSWER_S`` plus the peer timeout.

A launcher frozen (SIGSTOP) past that while the others moved on may later find itself first in its stale list and
host a rendezvous that nobody joins: it waits for the others the peer timeout, and ends below MIN naming them.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Callable
from typing import TypeVar

from jddp import net

RESERVE_TRIES = 20  # pairs of ports tried before giving up (another program took P - 1 each time)
ANSWER_S = 5.0  # beyond the peer timeout: how long a live candidate has to start hosting after node 0 is gone

T = TypeVar("T")


def local_address(coordinator: str) -> str:
    """The address of this host that reaches the ``--coordinator``'s host (no packet sent: a UDP socket's route).

    Example:
      >>> local_address("127.0.0.1:29500")
      '127.0.0.1'
    """
    host, port = net.split_address(coordinator)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Reservation:
    """This launcher's candidate ports: the rendezvous's (``listener``, listening) and the coordination service's
    (held by a bound socket until ``release_service_port``)."""

    def __init__(self, host: str) -> None:
        """Raises:
        OSError: no pair of free ports ``P - 1``, ``P`` was found on ``host`` in ``RESERVE_TRIES`` tries."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        for _ in range(RESERVE_TRIES):
            listener = socket.socket(family, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, 0))
            port = listener.getsockname()[1]
            # Without SO_REUSEADDR: a server that binds with SO_REUSEADDR and SO_REUSEPORT (gRPC's, as another job's
            # coordination service) would share the port while it is held; a socket never listened on leaves no
            # TIME_WAIT behind, so the service binds it at once once released.
            hold = socket.socket(family, socket.SOCK_STREAM)
            try:
                if port <= 1:
                    raise OSError(errno.EADDRINUSE, "no port below")
                hold.bind((host, port - 1))
            except OSError:
                listener.close()
                hold.close()
                continue
            listener.listen(256)
            self.host, self.port = host, port
            self.listener: socket.socket | None = listener
            self.hold: socket.socket | None = hold
            return
        raise OSError(
            errno.EADDRINUSE,
            f"no two free consecutive ports on {host} for this launcher's rendezvous and coordination service "
            f"(tried {RESERVE_TRIES} pairs): free some ports, or check that {host} is an address of this host",
        )

    @property
    def rendezvous(self) -> str:
        """The candidate address this launcher says when it joins."""
        return address(self.host, self.port)

    @property
    def coordinator(self) -> str:
        """The coordinator address of the rounds this launcher would host (the rendezvous at its port + 1)."""
        return address(self.host, self.port - 1)

    def take_listener(self) -> socket.socket:
        """The listening socket, handed to the rendezvous server this launcher now hosts (once)."""
        listener, self.listener = self.listener, None
        assert listener is not None, "the rendezvous socket was handed over already"
        return listener

    def release_service_port(self) -> None:
        """Frees ``P - 1`` for the coordination service, which binds it itself."""
        if self.hold is not None:
            self.hold.close()
            self.hold = None

    def close(self) -> None:
        for s in (self.listener, self.hold):
            if s is not None:
                with contextlib.suppress(OSError):
                    s.close()
        self.listener = self.hold = None


def succeed(order: list[str], mine: str, join: Callable[[str], T], say: Callable[[str], None]) -> tuple[str, T | None]:
    """Walks the candidates ``order`` after node 0's loss: ``("join", join(address))`` at the first other candidate
    that answers (``join`` raises ``OSError`` for one that does not, within its own timeout), ``("host", None)`` on
    reaching ``mine`` first, ``("none", None)`` when ``mine`` is not in ``order`` and nobody answered.

    Example:
      >>> def join(address):
      ...     if address == "b:2":
      ...         raise OSError("refused")
      ...     return address
      >>> succeed(["b:2", "c:3", "d:4"], "d:4", join, print)
      candidate b:2 did not answer (refused): trying the next
      ('join', 'c:3')
      >>> succeed(["b:2", "d:4", "c:3"], "d:4", join, print)
      candidate b:2 did not answer (refused): trying the next
      ('host', None)
    """
    for candidate in order:
        if candidate == mine:
            return "host", None
        try:
            return "join", join(candidate)
        except OSError as error:
            say(f"candidate {candidate} did not answer ({error.strerror or error}): trying the next")
    return "none", None
