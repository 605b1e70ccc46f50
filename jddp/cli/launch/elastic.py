"""The rounds of an elastic run (``--nnodes MIN:MAX``): node 0's launcher forms each round from the launchers
connected to its rendezvous (``jddp.cli.launch.rendezvous``), the others run the rounds they are given.

A round is one attempt of the fixed-membership launcher (``api.RoundLauncher.run_round``) with the round's nodes,
node rank, first process id and number of processes. Node 0 ends a round, and forms the next:

* at once, when a launcher of the round is gone (its connection closed, or silent for the peer timeout): the
  others' processes are stopped (told ``stop``) and the next round has one node fewer;
* when a round fails (a process failed): every node's launcher reports how its processes ended; a node whose
  processes failed first more than ``--max-restarts`` times is dropped (told ``end``), the others form the next
  round;
* to admit a node that joined while the round ran (up to MAX): it sends SIGTERM to its own processes, which agree
  on a step with every other process, save the checkpoint of that step and exit 75 (``jddp.Checkpointer``'s
  preemption); every launcher then joins the next round, the new node with them.

Fewer than MIN nodes left: the run ends, every launcher exits 69 naming the lost nodes. Node 0 runs the rendezvous
and the coordination service, and can be lost too: every round's message carries the ordered coordinator candidates
(``jddp.cli.launch.candidates``); when node 0 is gone the first surviving candidate hosts the next round as node 0
(``Host`` with ``first_round``), the others join it there (``jddp.cli.launch.member``).

Every process of a round gets ``JDDP_MEMBERSHIP`` (JSON: the round, its nodes and processes, the round before's and
why it changed), which the goodput ledger records; the launcher's summary lists the rounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import time

from jddp import exitcodes, net
from jddp.cli import reports
from jddp.cli.launch import api, candidates, member, rendezvous, workers
from jddp.cli.launch import config as config_lib

# After a round ends, how long node 0 waits for the launchers of that round to say they are ready for the next,
# beyond the peer timeout and the kill grace: a launcher always ends its round by then, or is gone.
READY_SLACK_S = 15.0
# A node waiting to join is admitted once the round's processes took their first step (fit's goodput ledger), or
# this long after the round started (a script without fit).
ADMIT_AFTER_S = 10.0


def run(launcher: api.RoundLauncher) -> int:
    """Runs ``launcher``'s elastic run: as node 0 when the rendezvous address can be bound here, else as a member."""
    c = launcher.config
    assert c.coordinator is not None and c.min_nodes is not None and c.max_nodes is not None  # checked by config
    address = reports.address(net.split_address(c.coordinator))
    silence = c.peer_timeout or config_lib.DEFAULT_PEER_TIMEOUT_S
    try:
        server = rendezvous.bind_or_none(*address, silence, launcher.token, launcher.say)
    except OSError as error:
        launcher.say(f"cannot listen for the rendezvous at {address[0]}:{address[1]}: {error}")
        return 1
    if server is not None:
        return Host(launcher, server).run()
    try:
        reservation: candidates.Reservation | None = candidates.Reservation(candidates.local_address(c.coordinator))
    except OSError as error:
        launcher.say(f"{error.strerror or error}; this launcher cannot succeed node 0 if node 0 is lost")
        reservation = None
    try:
        name = f"{socket.gethostname()}:{os.getpid()}"
        mine = reservation.rendezvous if reservation is not None else None
        client = rendezvous.Client(address, name, c.nprocs, c.join_timeout, silence, launcher.token, candidate=mine)
    except OSError as error:
        launcher.say(str(error))
        if reservation is not None:
            reservation.close()
        return 1

    def host(
        server: rendezvous.Server, base: config_lib.LaunchConfig, first_round: int, awaiting: list[str], lost: str
    ) -> int:
        return Host(launcher, server, base=base, first_round=first_round, awaiting=awaiting, why="node 0 lost",
                    lost=[lost]).run()  # fmt: skip

    return member.Guest(launcher, client, reservation, host).run()


@dataclasses.dataclass
class Round:
    """One round's membership as node 0 formed it."""

    number: int
    nodes: list[str]  # names, node 0 first
    processes: int
    why: str

    def describe(self) -> str:
        return f"round {self.number}: {len(self.nodes)} node(s), {self.processes} process(es) ({self.why})"


def membership_environment(current: Round, before: Round | None) -> str:
    """``JDDP_MEMBERSHIP``: this round's membership and the round before's, for the goodput ledger."""
    record = {"round": current.number, "nodes": len(current.nodes), "processes": current.processes, "why": current.why}
    if before is not None:
        record["before"] = {"round": before.number, "nodes": len(before.nodes), "processes": before.processes}
    return json.dumps(record)


def round_ahead(base: config_lib.LaunchConfig, current: Round) -> tuple[config_lib.LaunchConfig | None, str]:
    """The round after ``current`` where node 0 can know it ahead, and its membership: with two nodes and
    ``--nnodes`` MIN 1, should the other be lost, the next round is node 0 alone with its own processes, which then
    stand by for it (``jddp.runtime.standby``: joined, built, compiled). With more nodes the next round after a loss
    is one of several (one per node that may be lost: the process ids after the lost node's move down) and none is
    prepared; after a failure or an admission the round is not known either: spares at their imports serve those.

    >>> config = config_lib.LaunchConfig(target="train", module=True, nnodes=2, min_nodes=1, max_nodes=2, nprocs=2,
    ...                                  coordinator="127.0.0.1:1234")
    >>> ahead, membership = round_ahead(config, Round(3, ["a (node 0)", "b"], 4, "the first round"))
    >>> ahead.nnodes, ahead.world, ahead.node_rank, membership
    (1, 2, 0, '{"round": 4, "nodes": 1, "processes": 2, "why": "a node lost", "before": {"round": 3, "nodes": 2, \
"processes": 4}}')
    """
    assert base.min_nodes is not None
    if len(current.nodes) != 2 or base.min_nodes > 1:
        return None, ""
    alone = Round(current.number + 1, current.nodes[:1], base.nprocs, "a node lost")
    config = dataclasses.replace(base, nnodes=1, node_rank=0, process_offset=0, world=base.nprocs)
    return config, membership_environment(alone, current)


class Host:
    """Node 0: the rendezvous, the rounds, and its own processes in each."""

    def __init__(
        self,
        launcher: api.RoundLauncher,
        server: rendezvous.Server,
        *,
        base: config_lib.LaunchConfig | None = None,
        first_round: int = 0,
        awaiting: list[str] | None = None,
        why: str = "the first round",
        lost: list[str] | None = None,
    ) -> None:
        """A node 0 from the start, or (``first_round`` > 0) the successor of a node 0 that was lost: ``base`` with
        its own coordinator, the candidates ``awaiting`` that may still join it for round ``first_round``."""
        self.launcher, self.server = launcher, server
        self.base = base or launcher.config
        self.first_round, self.first_why = first_round, why
        self.awaiting = list(awaiting or [])
        c = self.base
        self.awaiting_by = time.monotonic() + (c.peer_timeout or config_lib.DEFAULT_PEER_TIMEOUT_S) + c.kill_grace
        self.awaiting_by += candidates.ANSWER_S
        self.say = launcher.say
        self.history: list[Round] = []
        self.failures = 0  # rounds that failed first on this node
        self.members: list[rendezvous.Member] = []  # the round's other nodes, by node rank
        self.admitting, self.admitting_since = False, 0.0
        self.lost: list[str] = list(lost or [])  # this round's nodes found gone, said once each
        self.round_start = 0.0
        self.told: set[int] = set()  # the launchers waiting to be admitted that were sent the candidates
        self.why = ""  # why the round being formed was formed
        self.failed_round: int | None = None  # a round that failed: its reports are read at the next gather

    def run(self) -> int:
        base, launcher = self.base, self.launcher
        launcher.receive_reports(self.server)  # the failure reports of the rounds arrive here
        if self.first_round == 0:
            self.say(
                f"elastic membership, {base.min_nodes} to {base.max_nodes} nodes: this launcher hosts the rendezvous "
                f"at {base.coordinator} port + 1 (node 0 of every round while it runs)"
            )
        else:
            self.say(
                f"this launcher is node 0 from round {self.first_round} on: it hosts the rendezvous at "
                f"{base.coordinator} port + 1 and the coordination service at {base.coordinator}; waiting up to "
                f"{self.awaiting_by - time.monotonic():.0f} s for the other candidates ({', '.join(self.awaiting)})"
            )
        number, why, code = self.first_round, self.first_why, 1
        try:
            while True:
                members = self.gather(number, why)
                if isinstance(members, int):
                    code = members
                    return code
                self.start_round(number, members, self.why)
                outcome, first_failed = launcher.run_round(number, self.hook)
                code, why = self.after_round(number, outcome, first_failed)
                if code is not None:
                    return code
                number += 1
        finally:
            self.say("membership history: " + "; ".join(r.describe() for r in self.history))
            # A launcher still connected (one waiting to be admitted, one of the round that has not ended yet) ends
            # with the run: 0 when it finished, else the failure's code (69 when node 0 itself failed)
            if code == 0:
                why, told = "the run finished", 0
            else:
                why, told = "node 0's launcher ended", code if code else exitcodes.EXIT_PEER_LOST
            for m in self.server.alive():
                self.server.drop(m, why, told)
            time.sleep(0.2)  # the last lines reach the others before the connections close
            self.server.close()

    # -- forming a round --------------------------------------------------------------
    def gather(self, number: int, why: str) -> list[rendezvous.Member] | int:
        """The other nodes of round ``number``, once they are ready (the exit code when the run must end)."""
        c, previous = self.base, {m.key for m in self.members}
        self.why = why
        assert c.min_nodes is not None and c.max_nodes is not None
        peer = c.peer_timeout or config_lib.DEFAULT_PEER_TIMEOUT_S
        now = time.monotonic()
        ready_by = now + peer + c.kill_grace + READY_SLACK_S
        join_by, min_reached = now + c.join_timeout, None
        if number == 0:
            self.say(f"waiting for {c.min_nodes - 1} to {c.max_nodes - 1} other node(s) to join")
        while True:
            if self.launcher.signal_received is not None:
                return 128 + self.launcher.signal_received
            alive = self.server.alive()
            late = [m for m in alive if m.key in previous and m.ready < number]
            if late and time.monotonic() < ready_by:
                self.server.wait(0.2)
                continue
            for m in late:
                self.server.drop(m, f"it did not end round {number - 1} in time", exitcodes.EXIT_PEER_LOST)
            if self.failed_round is not None:
                said = self.attribute(self.failed_round)
                self.failed_round = None
                if said is not None:
                    self.why = f"{why}: {said}"
            if self.awaiting:  # a successor of node 0: the survivors of the round before find it in their order
                joined = {m.candidate for m in self.server.alive()}
                if not set(self.awaiting) <= joined and time.monotonic() < self.awaiting_by:
                    self.server.wait(0.2)
                    continue
                self.awaiting = []
            joining = [m for m in self.server.alive() if m.key in previous or m.ready < number]
            count = 1 + len(joining)
            if count < c.min_nodes:
                if number == 0 and time.monotonic() < join_by:
                    self.server.wait(0.2)
                    continue
                lost = "; ".join(self.lost) or "none lost"
                said = (
                    f"only {count} of the {c.min_nodes} node(s) needed joined in --join-timeout={c.join_timeout:g} s"
                    if number == 0
                    else f"{count} node(s) left, below --nnodes MIN={c.min_nodes} (lost: {lost})"
                )
                self.say(f"the run cannot go on: {said}; ending it (exit {exitcodes.EXIT_PEER_LOST})")
                for m in self.server.alive():
                    self.server.drop(m, said, exitcodes.EXIT_PEER_LOST)
                return exitcodes.EXIT_PEER_LOST
            if number == 0 and count < c.max_nodes:
                min_reached = min_reached or time.monotonic()
                if time.monotonic() - min_reached < c.join_wait:
                    self.server.wait(0.2)
                    continue
            return joining[: c.max_nodes - 1]

    def start_round(self, number: int, members: list[rendezvous.Member], why: str) -> None:
        c, launcher = self.base, self.launcher
        sizes = [c.nprocs] + [m.nprocs for m in members]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        names = [f"{socket.gethostname()}:{os.getpid()} (node 0)"] + [m.name for m in members]
        current = Round(number, names, sum(sizes), why)
        before = self.history[-1] if self.history else None
        self.history.append(current)
        self.members, self.admitting, self.lost = members, False, []
        waiting = [m for m in self.server.alive() if m not in members]
        order = [m.candidate for m in members + waiting if m.candidate is not None]
        for rank, m in enumerate(members, 1):
            m.send(
                {
                    "op": "round",
                    "coordinator": c.coordinator,
                    "candidates": order,
                    "run_start": launcher.run_start,
                    "round": number,
                    "node_rank": rank,
                    "nnodes": len(sizes),
                    "process_offset": offsets[rank],
                    "world": current.processes,
                    "membership": membership_environment(current, before),
                }
            )
        for m in waiting:  # not in this round: they learn who succeeds node 0 if it is lost
            m.send({"op": "candidates", "candidates": order, "round": number, "run_start": launcher.run_start})
        config = dataclasses.replace(c, nnodes=len(sizes), node_rank=0, process_offset=0, world=sum(sizes))
        launcher.set_round(config, membership_environment(current, before))
        launcher.set_round_ahead(*round_ahead(c, current))
        self.say(current.describe() + ": " + ", ".join(f"node {i}: {n}" for i, n in enumerate(names)))
        self.round_start = time.monotonic()

    # -- while a round runs ----------------------------------------------------------
    def hook(self) -> tuple[str, workers.Worker | None] | None:
        """Called by the launcher's watch: ends the round when a node of it is gone; starts an admission."""
        c, launcher = self.base, self.launcher
        assert c.max_nodes is not None
        gone = [m for m in self.members if m.gone is not None and not m.finished]
        if gone:
            for m in gone:
                rank = self.members.index(m) + 1
                self.lost.append(f"node {rank} ({m.name}): {m.gone}")
                self.say(f"node {rank} ({m.name}) is lost: {m.gone}; ending round {len(self.history) - 1}")
            for m in self.members:
                m.send({"op": "stop", "round": len(self.history) - 1})
            launcher.stop_for_restart()
            return "lost", None
        if self.admitting and time.monotonic() - self.admitting_since > c.term_timeout:
            # processes that save nothing on SIGTERM (no jddp.Checkpointer) end now: the round resumes from the last
            # checkpoint, as after a failure, rather than never admitting the node
            self.say(f"this node's processes did not end {c.term_timeout:g} s after the SIGTERM: stopping them")
            for m in self.members:
                m.send({"op": "stop", "round": len(self.history) - 1})
            launcher.stop_for_restart()
            return "lost", None
        waiting = [m for m in self.server.alive() if m not in self.members]
        if any(m.key not in self.told for m in waiting):  # joined while the round runs: every launcher learns the
            self.told |= {m.key for m in waiting}  # longer order of candidates, should node 0 be lost before the next
            order = [n.candidate for n in self.members + waiting if n.candidate is not None]
            number = self.history[-1].number if self.history else -1
            for m in self.members + waiting:
                m.send({"op": "candidates", "candidates": order, "round": number, "run_start": launcher.run_start})
        if waiting and not self.admitting and len(self.members) + 1 < c.max_nodes:
            started = launcher.first_step_taken()
            if started or time.monotonic() - self.round_start > ADMIT_AFTER_S:
                self.admitting, self.admitting_since = True, time.monotonic()
                names = ", ".join(m.name for m in waiting)
                self.say(
                    f"{names} waiting to join: ending round {len(self.history) - 1} at a step every process agrees "
                    "on, with its checkpoint saved (SIGTERM to this node's processes: the preemption save)"
                )
                launcher.signal_all(signal.SIGTERM)
        return None

    def after_round(self, number: int, outcome: str, first_failed: workers.Worker | None) -> tuple[int | None, str]:
        """What follows round ``number``: ``(exit code, "")`` when the run ends, else ``(None, why)`` of the next."""
        c, launcher = self.base, self.launcher
        if outcome == "ok":
            self.await_members(number)
            return launcher.exit_code(outcome, first_failed), ""
        if outcome == "signal" or (outcome == "preempted" and not self.admitting):
            code = launcher.exit_code(outcome, first_failed)
            for m in self.server.alive():
                self.server.drop(m, f"node 0's processes ended ({exitcodes.describe(code)})", code)
            return code, ""
        if self.admitting:
            return None, "admitting a node"
        for m in self.members:  # the round failed: the others' processes end now
            m.send({"op": "stop", "round": number})
        if outcome == "lost":
            return None, "a node lost"
        self.failed_round = number  # the others' reports of it are counted once they are ready (gather)
        why = "a process failed"
        if first_failed is not None and first_failed.code is not None:
            if not exitcodes.is_peer_failure(first_failed.code):
                self.failures += 1
                if self.failures > c.max_restarts:
                    code = launcher.exit_code("failed", first_failed)
                    for m in self.server.alive():
                        self.server.drop(m, "node 0's restarts are spent", code)
                    return code, ""
                why = f"process {first_failed.process_id} failed on node 0"
        return None, why

    def await_members(self, number: int) -> None:
        """After node 0's processes finished: waits (up to the peer timeout) for the others to say theirs did."""
        c = self.base
        deadline = time.monotonic() + (c.peer_timeout or config_lib.DEFAULT_PEER_TIMEOUT_S)
        while time.monotonic() < deadline and any(m.gone is None for m in self.members):
            self.server.wait(0.2)

    def attribute(self, number: int) -> str | None:
        """Counts round ``number``'s failures reported by the other nodes; drops those whose restarts are spent."""
        c, said = self.base, None
        for r in self.server.reports(number):
            if 0 < r.node <= len(self.members) and not exitcodes.is_peer_failure(r.code):
                m = self.members[r.node - 1]
                m.failures += 1
                said = f"node {r.node}: {r.what}"
                if m.failures > c.max_restarts:
                    self.server.drop(
                        m, f"its processes failed {m.failures} time(s), more than --max-restarts={c.max_restarts}: "
                        "the group goes on without it", r.code if r.code > 0 else 128 - r.code
                    )  # fmt: skip
        return said
