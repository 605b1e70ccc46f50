"""Coordinator candidates (``jddp.cli.launch.candidates``): the ports a launcher reserves to succeed node 0, the
order the survivors walk, and a rendezvous served on a reserved socket. In one process, on loopback."""

from __future__ import annotations

import errno
import itertools
import socket
import time

import pytest

from jddp.cli import reports
from jddp.cli.launch import candidates, rendezvous

TOKEN = b"t" * 32


def test_a_reservation_holds_the_rendezvous_port_and_the_service_port_below_it():
    reservation = candidates.Reservation("127.0.0.1")
    try:
        assert reservation.rendezvous == f"127.0.0.1:{reservation.port}"
        assert reservation.coordinator == f"127.0.0.1:{reservation.port - 1}"
        for port in (reservation.port - 1, reservation.port):  # both held: nothing else binds them
            with socket.socket() as s, pytest.raises(OSError) as error:
                s.bind(("127.0.0.1", port))
            assert error.value.errno == errno.EADDRINUSE
        reservation.release_service_port()  # the coordination service binds it itself
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", reservation.port - 1))
    finally:
        reservation.close()


def test_the_local_address_is_the_one_towards_the_coordinator():
    assert candidates.local_address("127.0.0.1:29500") == "127.0.0.1"
    assert candidates.local_address("[::1]:29500") in ("::1", "127.0.0.1")  # no IPv6 here: the fallback


# Every order of up to 4 candidates, with this launcher at every place and every set of the others gone: the walk
# joins the first live one before this launcher's place, else hosts. Generated, not listed.
WALKS = [
    (n, mine, frozenset(dead))
    for n in range(1, 5)
    for mine in range(n)
    for k in range(n)
    for dead in itertools.combinations([i for i in range(n) if i != mine], k)
]


@pytest.mark.parametrize(("n", "mine", "dead"), WALKS, ids=lambda v: str(sorted(v) if isinstance(v, frozenset) else v))
def test_the_walk_joins_the_first_live_candidate_before_this_one_else_hosts(n, mine, dead):
    order = [f"10.0.0.{i}:{1000 + i}" for i in range(n)]
    tried: list[str] = []

    def join(address: str) -> str:
        tried.append(address)
        if order.index(address) in dead:
            raise OSError(errno.ECONNREFUSED, "Connection refused")
        return address

    kind, joined = candidates.succeed(order, order[mine], join, lambda _: None)
    alive_before = [i for i in range(mine) if i not in dead]
    if alive_before:
        assert (kind, joined) == ("join", order[alive_before[0]])
        assert tried == order[: alive_before[0] + 1]
    else:
        assert (kind, joined) == ("host", None)
        assert tried == order[:mine]  # never itself


def test_the_walk_without_this_launcher_in_the_order_ends_with_none():
    def join(address: str) -> str:
        raise OSError(errno.ECONNREFUSED, "Connection refused")

    assert candidates.succeed(["a:1", "b:2"], "c:3", join, lambda _: None) == ("none", None)


def test_a_candidate_that_is_gone_is_passed_at_once_not_after_the_join_timeout():
    """A refused connection ends the tries at once with ``retry_refused=False``: the survivors do not wait the peer
    timeout on each dead candidate."""
    reservation = candidates.Reservation("127.0.0.1")
    port = reservation.port
    reservation.close()  # the candidate is gone: its port refuses
    started = time.monotonic()
    with pytest.raises(OSError) as error:
        rendezvous.Client(("127.0.0.1", port), "x", 1, 20.0, 10.0, TOKEN, retry_refused=False)
    assert error.value.errno == errno.ECONNREFUSED
    assert time.monotonic() - started < 10  # not the 20 s join timeout (a refusal takes milliseconds)


def test_a_rendezvous_served_on_a_reserved_socket_admits_a_member_learns_its_candidate_and_refuses_a_stray():
    host_side, member_side = candidates.Reservation("127.0.0.1"), candidates.Reservation("127.0.0.1")
    server = rendezvous.Server("127.0.0.1", host_side.port, 10.0, TOKEN, listener=host_side.take_listener())
    try:
        client = rendezvous.Client(("127.0.0.1", host_side.port), "m", 2, 30.0, 10.0, TOKEN,
                                   candidate=member_side.rendezvous)  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while not server.alive() and time.monotonic() < deadline:
                server.wait(0.1)
            (member,) = server.alive()
            assert (member.name, member.nprocs, member.candidate) == ("m", 2, member_side.rendezvous)
            # the successor's rendezvous still requires the job token: another is refused, named, and not admitted
            with pytest.raises(reports.Refused, match="job token differs"):
                rendezvous.Client(("127.0.0.1", host_side.port), "stray", 1, 30.0, 10.0, b"s" * 32)
            assert [m.name for m in server.alive()] == ["m"]
        finally:
            client.close()
    finally:
        server.close()
        host_side.close()
        member_side.close()
