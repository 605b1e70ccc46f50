"""A node other than 0 of an elastic run (``Guest``): joins node 0's rendezvous, runs the rounds it is given, and
when node 0 is lost finds its successor among the coordinator candidates, or becomes it.

Node 0's loss is survived like any other node's while MIN nodes remain: this launcher stops its processes at once
(their snapshots stay in memory, as when another node is lost), walks the candidates node 0 sent with the last round
(``jddp.cli.launch.candidates``), and joins the first that answers with the job's token; or, reaching its own
address first, hosts the rendezvous and the coordination service of the next round itself (``host``, given by
``jddp.cli.launch.elastic``). Node 0 sends the list with every round, and to every launcher when one joins while a
round runs. Without a list (node 0 lost before it saw this launcher join) or when no candidate answers, it ends with
a summary of what was lost and how to go on, exit 69.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable

from jddp import exitcodes, net
from jddp.cli.launch import api, candidates, rendezvous, workers
from jddp.cli.launch import config as config_lib

ROUND_FIELDS = ("round", "nnodes", "node_rank", "process_offset", "world")


class Guest:
    """A node other than 0: joins node 0's rendezvous and runs the rounds it is given.

    ``host(server, base, first_round, awaiting, lost)`` runs the rounds as node 0 (``elastic.Host``) when this
    launcher succeeds a lost node 0 (``lost`` says which and why), and returns the exit code.
    """

    def __init__(
        self,
        launcher: api.RoundLauncher,
        client: rendezvous.Client,
        reservation: candidates.Reservation | None,
        host: Callable[[rendezvous.Server, config_lib.LaunchConfig, int, list[str], str], int],
    ) -> None:
        self.launcher, self.client, self.reservation, self.host = launcher, client, reservation, host
        self.base = launcher.config
        self.say = launcher.say
        self.ended: tuple[int, str] | None = None  # node 0's "end" (code, why)
        self.host_gone: str | None = None
        self.gone_why = ""  # why node 0 was found gone, for the summaries
        self.order: list[str] = []  # the coordinator candidates, as node 0 sent them last
        self.last_round = -1
        self.known_round = -1  # the newest round node 0 said it ran (a launcher waiting to be admitted ran none)
        self.node0 = f"{self.base.coordinator} port + 1"  # the rendezvous this launcher is a member of

    def run(self) -> int:
        launcher, c = self.launcher, self.base
        self.say(f"elastic membership: joined the rendezvous at {c.coordinator} port + 1; waiting for a round")
        try:
            while True:
                message = self.next_round()
                if isinstance(message, int):
                    return message
                if message is None:  # node 0 is gone: its successor, or this launcher is it
                    code = self.succeed()
                    if code is not None:
                        return code
                    continue
                number = self.last_round = message["round"]
                run_start = message.get("run_start")
                if isinstance(run_start, float):  # node 0's: the goodput ledger's run goes on after node 0's loss
                    launcher.run_start = run_start
                coordinator = message.get("coordinator")
                config = dataclasses.replace(
                    c,
                    coordinator=coordinator if isinstance(coordinator, str) else c.coordinator,
                    nnodes=message["nnodes"],
                    node_rank=message["node_rank"],
                    process_offset=message["process_offset"],
                    world=message["world"],
                )
                launcher.set_round(config, message.get("membership"))
                outcome, first_failed = launcher.run_round(number, self.hook)
                if self.ended is not None:
                    code, why = self.ended
                    self.say(f"node 0 ended the run: {why} (exit {code})")
                    return code
                if self.host_gone is not None:
                    self.host_gone = None
                    code = self.succeed()
                    if code is not None:
                        return code
                    continue
                if outcome == "signal":
                    code = launcher.exit_code(outcome, first_failed)
                    self.client.send({"op": "leave", "why": f"stopped by a signal (exit {code})"})
                    return code
                if outcome == "ok":
                    self.client.send({"op": "leave", "code": 0, "why": "its processes finished"})
                    return launcher.exit_code(outcome, first_failed)
                self.client.send({"op": "ready", "round": number + 1})
        finally:
            time.sleep(0.2)
            self.client.close()
            if self.reservation is not None:
                self.reservation.close()

    def take_candidates(self, message: dict) -> None:
        """The coordinator candidates node 0 sent, and with them its round and run start: a successor that never
        ran a round numbers the next one after node 0's and goes on with node 0's run (its goodput ledger)."""
        order = message.get("candidates")
        if isinstance(order, list) and all(isinstance(a, str) for a in order):
            self.order = order
        number, run_start = message.get("round"), message.get("run_start")
        if isinstance(number, int) and not isinstance(number, bool) and number > self.known_round:
            self.known_round = number
        if isinstance(run_start, float):
            self.launcher.run_start = run_start

    def next_round(self) -> dict | int | None:
        """Node 0's next ``round`` message, None when node 0 is gone, or the exit code when the run ends (``end``,
        a signal)."""
        while True:
            if self.launcher.signal_received is not None:
                self.client.send({"op": "leave", "why": "stopped by a signal"})
                return 128 + self.launcher.signal_received
            message = self.client.next_message(0.2)
            if message is None:
                gone = self.client.gone()
                if gone is not None:
                    self.say(f"node 0's rendezvous is gone ({gone})")
                    self.gone_why = gone
                    return None
                continue
            if message.get("op") == "end":
                code = message.get("code")
                code = code if isinstance(code, int) and not isinstance(code, bool) else 1
                self.say(f"node 0 ended the run: {message.get('why', '')} (exit {code})")
                return code
            if message.get("op") == "candidates":  # waiting to be admitted
                self.take_candidates(message)
                self.say("should node 0 be lost before the next round, its successor is the first to answer of: "
                         + ", ".join(self.order))  # fmt: skip
            if message.get("op") == "round" and all(isinstance(message.get(k), int) for k in ROUND_FIELDS):
                self.take_candidates(message)
                return message

    def hook(self) -> tuple[str, workers.Worker | None] | None:
        """Called by the launcher's watch: node 0 said ``stop`` or ``end``, or is gone. What node 0 said is read
        before its connection's end is judged: node 0 ends a run by saying ``end`` and closing, and that close must
        not be taken for its loss (the member would succeed it and go on with a run node 0 ended)."""
        launcher = self.launcher
        while (message := self.client.next_message(0)) is not None:
            if message.get("op") == "end":
                code = message.get("code")
                code = code if isinstance(code, int) and not isinstance(code, bool) else 1
                self.ended = (code, str(message.get("why")))
                launcher.stop_all(self.base.kill_grace)
                return "lost", None
            if message.get("op") == "candidates":
                self.take_candidates(message)
            if message.get("op") == "stop" and message.get("round") == launcher.attempt:  # not a late one
                self.say("node 0 ended the round: stopping this node's processes")
                launcher.stop_for_restart()
                return "lost", None
        gone = self.client.gone()
        if gone is not None:
            self.host_gone = self.gone_why = gone
            self.say(f"node 0's rendezvous is gone ({gone}): stopping this node's processes, as for a lost node")
            launcher.stop_for_restart()
            return "lost", None
        return None

    # -- node 0 lost ------------------------------------------------------------------
    def succeed(self) -> int | None:
        """After node 0's loss: joins its successor (None: the rounds go on) or hosts them (their exit code), or
        ends the run with what was lost and how to go on (exit 69)."""
        c = self.base
        silence = c.peer_timeout or config_lib.DEFAULT_PEER_TIMEOUT_S
        while (message := self.client.next_message(0)) is not None:  # node 0's last lines, read before its end
            if message.get("op") == "candidates":
                self.take_candidates(message)
            if message.get("op") == "end":  # node 0 ended the run before it closed: not a loss to succeed
                code = message.get("code")
                code = code if isinstance(code, int) and not isinstance(code, bool) else 1
                self.say(f"node 0 ended the run: {message.get('why', '')} (exit {code})")
                return code
        mine = self.reservation.rendezvous if self.reservation is not None else None
        if not self.order or mine is None:
            return self.cannot_go_on("no coordinator candidate is known here" if mine else "this launcher has none")
        self.say(f"node 0 is lost {self.after()}: trying the coordinator candidates in order: "
                 + ", ".join(self.order))  # fmt: skip

        def join(address: str) -> rendezvous.Client:
            where = net.split_address(address, name="candidate")
            name = f"{socket.gethostname()}:{os.getpid()}"
            return rendezvous.Client(where, name, c.nprocs, silence + candidates.ANSWER_S, silence,
                                     self.launcher.token, candidate=mine, retry_refused=False)  # fmt: skip

        kind, client = candidates.succeed(self.order, mine, join, self.say)
        if kind == "join" and client is not None:
            self.client.close()
            self.client = client
            self.node0 = client_address(client)
            self.say(f"joined the rendezvous of the next node 0 at {self.node0}; waiting for a round")
            return None
        if kind == "host":
            assert self.reservation is not None
            server = rendezvous.Server(
                self.reservation.host, self.reservation.port, silence, self.launcher.token, self.say,
                listener=self.reservation.take_listener(),
            )  # fmt: skip
            self.reservation.release_service_port()
            self.client.close()
            awaiting = self.order[self.order.index(mine) + 1 :]
            base = dataclasses.replace(c, coordinator=self.reservation.coordinator)
            first_round = max(self.last_round, self.known_round) + 1
            return self.host(server, base, first_round, awaiting, f"node 0 ({self.node0}): {self.gone_why}")
        return self.cannot_go_on("no coordinator candidate answered")

    def after(self) -> str:
        return f"after round {self.last_round}" if self.last_round >= 0 else "before this launcher ran a round"

    def cannot_go_on(self, why: str) -> int:
        """The run ends here: says what was lost, where it stood, and the command that goes on from the checkpoint."""
        command = shlex.join(["jddp", "launch", *sys.argv[1:]])
        self.say(
            f"the run cannot go on without node 0 ({self.node0}): {why}. Lost: node 0 ({self.gone_why}), "
            f"{self.after()}. The run resumes from its newest checkpoint (the script's checkpoint directory) when "
            f"its launchers start again, the same line on each node: {command} (exit {exitcodes.EXIT_PEER_LOST})"
        )
        return exitcodes.EXIT_PEER_LOST


def client_address(client: rendezvous.Client) -> str:
    host, port = client.connection.getpeername()[:2]
    return candidates.address(host, port)
