"""Coordinator candidates (``jddp.cli.launch.candidates``): the ports a launcher reserves to succeed node 0, the
order the survivors walk, and a rendezvous served on a reserved socket. In one process, on loopback."""

from __future__ import annotations

import dataclasses
import errno
import itertools
import socket
import time

import pytest

from jddp.cli import reports
from jddp.cli.launch import candidates, member, rendezvous

TOKEN = b"t" * 32


def test_a_reservation_holds_the_rendezvous_port_and_the_service_port_below_it():
    reservation = candidates.Reservation("127.0.0.1")
    try:
        assert reservation.rendezvous == f"127.0.0.1:{reservation.port}"
        assert reservation.coordinator == f"127.0.0.1:{reservation.port - 1}"
        for port in (reservation.port - 1, reservation.port):  # both held: nothing else binds them
            for options in ((), (socket.SO_REUSEADDR,), (socket.SO_REUSEADDR, socket.SO_REUSEPORT)):  # gRPC's too
                with socket.socket() as s, pytest.raises(OSError) as error:
                    for option in options:
                        s.setsockopt(socket.SOL_SOCKET, option, 1)
                    s.bind(("127.0.0.1", port))
                assert error.value.errno == errno.EADDRINUSE, (port, options)
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


@dataclasses.dataclass
class _MemberConfig:
    coordinator: str = "127.0.0.1:1"
    peer_timeout: float = 10.0
    kill_grace: float = 1.0
    nprocs: int = 1


class _MemberLauncher:
    def __init__(self):
        self.config, self.token, self.attempt, self.said, self.stopped = _MemberConfig(), TOKEN, 3, [], 0
        self.signal_received = None

    def say(self, text):
        self.said.append(text)

    def stop_for_restart(self):
        self.stopped += 1

    def stop_all(self, grace):
        self.stopped += 1


def test_node_0s_end_is_not_taken_for_its_loss_when_its_close_is_seen_first():
    """Node 0 ends the run (``end``, then closes 0.2 s later); a member whose watch comes round after the close
    ends with node 0's code, and neither succeeds node 0 nor hosts a round of a run node 0 ended."""
    server = rendezvous.Server("127.0.0.1", 0, 10.0, TOKEN)
    port = server._socket.getsockname()[1]
    reservation = candidates.Reservation("127.0.0.1")
    client = rendezvous.Client(("127.0.0.1", port), "b:1", 1, 10.0, 10.0, TOKEN, candidate=reservation.rendezvous)
    hosted = []

    def host(srv, base, first_round, awaiting, lost):
        hosted.append((first_round, lost))
        srv.close()
        return 0

    launcher = _MemberLauncher()
    guest = member.Guest(launcher, client, reservation, host)  # pyright: ignore[reportArgumentType]
    guest.order, guest.last_round = [reservation.rendezvous], 3
    for _ in range(50):
        if server.alive():
            break
        time.sleep(0.05)
    (m,) = server.alive()
    server.drop(m, "node 0's processes ended (SIGINT)", 130)  # Host.after_round's 'signal' path, then its finally:
    time.sleep(0.2)
    server.close()
    deadline = time.monotonic() + 5  # the member's watch comes round after the close (FIN: the next beat frees it)
    while client.gone() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    guest.hook()
    assert guest.ended == (130, "node 0's processes ended (SIGINT)"), (guest.ended, guest.host_gone)
    code = guest.succeed() if guest.host_gone is not None else guest.ended[0]
    assert hosted == [] and code == 130, (hosted, code, launcher.said)
    guest.client.close()
    reservation.close()


def test_a_waiting_launcher_that_succeeds_node_0_numbers_the_next_round_after_node_0s_and_goes_on_with_its_run():
    """``--nnodes 1:2`` with a second launcher waiting to be admitted while node 0 runs round 5 alone: node 0 is lost,
    the waiting launcher is the only candidate and hosts round 6 (not round 0 again) with node 0's run start, so the
    goodput ledger goes on with the same run."""
    server = rendezvous.Server("127.0.0.1", 0, 10.0, TOKEN)
    port = server._socket.getsockname()[1]
    reservation = candidates.Reservation("127.0.0.1")
    client = rendezvous.Client(("127.0.0.1", port), "w:1", 1, 10.0, 10.0, TOKEN, candidate=reservation.rendezvous)
    hosted = []
    launcher = _MemberLauncher()
    launcher.run_start = 111.0  # this launcher's own start

    def host(srv, base, first_round, awaiting, lost):
        hosted.append(first_round)
        srv.close()
        return 0

    guest = member.Guest(launcher, client, reservation, host)  # pyright: ignore[reportArgumentType]
    for _ in range(50):
        if server.alive():
            break
        time.sleep(0.05)
    (m,) = server.alive()
    m.send({"op": "candidates", "candidates": [reservation.rendezvous], "round": 5, "run_start": 42.5})
    time.sleep(0.2)
    server.close()
    assert guest.next_round() is None  # node 0 gone
    assert guest.succeed() == 0
    assert hosted == [6] and launcher.run_start == 42.5
    reservation.close()


def _slow_rendezvous(monkeypatch, delay_s: float) -> rendezvous.Server:
    """A rendezvous whose thread verifies each join ``delay_s`` late (a launcher starved of CPU)."""
    original = reports.opened

    def slow(line, token, nonce):
        time.sleep(delay_s)
        return original(line, token, nonce)

    monkeypatch.setattr(rendezvous.reports, "opened", slow)
    return rendezvous.Server("127.0.0.1", 0, 30.0, TOKEN)


def test_a_rendezvous_that_answers_late_admits_a_launcher_with_the_right_token(monkeypatch):
    """An answer later than one read's timeout is awaited until the join's deadline: no answer is no refusal."""
    server = _slow_rendezvous(monkeypatch, 2.5)
    try:
        client = rendezvous.Client(("127.0.0.1", server._socket.getsockname()[1]), "b:1", 1, 30.0, 30.0, TOKEN)
        client.close()
    finally:
        server.close()


def test_a_successor_that_answers_late_is_joined_not_passed_over(monkeypatch):
    """Node 0's successor B hosts round N + 1 and answers late; C, after B in the order, joins B rather than taking
    B for gone and hosting too (two node 0s of one round)."""
    server = _slow_rendezvous(monkeypatch, 2.5)
    b = f"127.0.0.1:{server._socket.getsockname()[1]}"
    mine = "127.0.0.1:1"

    def join(address):
        host, port = address.rsplit(":", 1)
        return rendezvous.Client((host, int(port)), "c:1", 1, 35.0, 30.0, TOKEN, candidate=mine, retry_refused=False)

    said: list[str] = []
    try:
        kind, client = candidates.succeed([b, mine], mine, join, said.append)
        if client is not None:
            client.close()
    finally:
        server.close()
    assert kind == "join", said
