"""This launcher among those of the other nodes (``--nnodes > 1``; a fixed membership): node 0 serves their reports
of a failed attempt (``jddp.cli.reports``) and acts on them; the others report there and watch node 0's
coordination service; after a failure of its own, node 0 keeps its service up for the others' processes."""

from __future__ import annotations

import time
from collections.abc import Callable

from jddp import exitcodes, net
from jddp.cli import output, reports
from jddp.cli.launch import config as config_lib
from jddp.cli.launch import failure, rendezvous, workers

# Nodes other than 0: how long node 0's coordination service may go unanswered (after it first answered) before
# this node's processes, still running, are stopped: the group has ended there (a frozen process here never would).
SERVICE_GONE_S = 5.0


class Nodes:
    """The other nodes as this one sees them: their reports (node 0 of several) or node 0's service (the others)."""

    def __init__(self, config: config_lib.LaunchConfig, out: output.Output) -> None:
        self.config = config
        self.output = out
        # Node 0 of several: the other launchers' reports (elastic: the rendezvous, jddp.cli.launch.rendezvous).
        self.reports: reports.ReportServer | rendezvous.Server | None = None
        # The others of a fixed membership: their connection to node 0's launcher (what it tells them).
        self.subscription: reports.Subscription | None = None
        self.token = b""  # the job's (jddp.cli.job_token), set by ``open``
        self.probed_at, self.service_answered, self.service_silent_since = 0.0, False, None
        self.remote_deadline: float | None = None

    def open(self, token: bytes) -> None:
        """Node 0 of several: listens for the other launchers' reports, on the coordinator's port + 1; the others:
        say hello there with the job's ``token`` (before anything starts) and keep the connection for the run.

        Raises:
          OSError: the port is taken; node 0's launcher did not answer within ``--join-timeout``, or refused this
            launcher's token (``reports.Refused``).
        """
        c, self.token = self.config, token
        if c.nnodes == 1 or c.elastic:  # elastic: the rendezvous takes the reports
            return
        assert c.coordinator is not None  # --nnodes > 1 requires it
        address = reports.address(net.split_address(c.coordinator))
        if c.node_rank == 0:
            self.reports = reports.ReportServer(*address, c.nnodes, token, self.output.say)
        else:
            self.subscription = reports.Subscription(address, c.node_rank, token, c.join_timeout)

    def close(self) -> None:
        if self.reports is not None:
            self.reports.close()
        if self.subscription is not None:
            self.subscription.close()

    def tell_silent(self, attempt: int, processes: set[int]) -> None:
        """Node 0 of a fixed membership: tells the other launchers which of their processes a process here found
        silent (``reports.ReportServer.tell_silent``), so that each stops its own at once."""
        if isinstance(self.reports, reports.ReportServer) and processes:
            self.reports.tell_silent(attempt, processes)

    def silent_elsewhere(self, attempt: int) -> set[int]:
        """The others of a fixed membership: the processes node 0's launcher said a process of its found silent."""
        return self.subscription.silent(attempt) if self.subscription is not None else set()

    def reported(self, attempt: int) -> list[reports.Report]:
        """The other nodes' reports of a failure in ``attempt`` (none but on node 0 of several)."""
        return self.reports.reports(attempt) if self.reports is not None else []

    def watch_start(self) -> None:
        """An attempt's watch begins: node 0's service not probed yet, no deadline for this node's processes."""
        self.probed_at, self.service_answered, self.service_silent_since = 0.0, False, None
        self.remote_deadline = None

    def service_gone(self) -> bool:
        """On nodes other than 0: whether node 0's coordination service, which answered before, has not answered
        for ``SERVICE_GONE_S`` (probed once a second)."""
        if self.config.node_rank == 0 or self.config.coordinator is None:
            return False
        now = time.monotonic()
        if now - self.probed_at < 1.0:
            return self.service_silent_since is not None and now - self.service_silent_since > SERVICE_GONE_S
        self.probed_at = now
        if net.answers(*net.split_address(self.config.coordinator)):
            self.service_answered, self.service_silent_since = True, None
        elif self.service_answered and self.service_silent_since is None:
            self.service_silent_since = now
        return self.service_silent_since is not None and now - self.service_silent_since > SERVICE_GONE_S

    def remote_failure(self, attempt: int, group: workers.WorkerGroup) -> bool:
        """Node 0 of several: acts on the other launchers' reports of a failed attempt (``jddp.cli.reports``);
        returns whether this node's processes were stopped for it.

        With a restart to follow, they are stopped at once. Otherwise they get the time they would get after a
        failure here, to end by themselves and name what they lost: the peer timeout + 5 s when the first failure
        there was a process of that node's own, 5 s when it was a lost peer (then a process of this node is the one
        lost: still running after that, it is the frozen one).
        """
        elsewhere = self.reported(attempt)
        if not elsewhere or all(w.code is not None for w in group.workers):
            return False
        said = "; ".join(f"node {r.node}: {r.what}" for r in elsewhere)
        for r in elsewhere:  # a process of this node that a survivor there found silent: stopped at once
            group.stop_silent(set(r.silent), f"a process of node {r.node}")
        if self.config.elastic or attempt < self.config.max_restarts:
            self.output.say(f"the group failed on another node ({said}); a restart follows: stopping this node's")
            group.stop_for_restart()
            return True
        if self.remote_deadline is None:
            own = any(not exitcodes.is_peer_failure(r.code) for r in elsewhere)
            wait = (
                (self.config.peer_timeout or config_lib.DEFAULT_PEER_TIMEOUT_S) + 5 if own else failure.PEER_LOST_WAIT_S
            )
            self.remote_deadline = time.monotonic() + wait
            self.output.say(
                f"the group failed on another node ({said}); waiting up to {wait:g} s for this node's processes "
                "to end, then stopping them"
            )
        if time.monotonic() < self.remote_deadline:
            return False
        group.stop_all(self.config.kill_grace)
        group.poll()
        return True

    def report(self, attempt: int, first_failed: workers.Worker | None, notes: dict[int, dict]) -> None:
        """Nodes other than 0: tells node 0's launcher that this attempt failed here (``jddp.cli.reports``), so that a
        process frozen on node 0, which would never notice by itself, is stopped there too."""
        assert self.config.coordinator is not None  # --nnodes > 1 requires it
        if first_failed is not None and first_failed.code == 0:  # exited 0 early: its peers stopped (the others' 69)
            code, what = (
                exitcodes.EXIT_PEER_LOST,
                f"process {first_failed.process_id} exited 0 while its peers needed it",
            )
        elif first_failed is not None and first_failed.code is not None:
            code, what = first_failed.code, f"process {first_failed.process_id} {exitcodes.describe(first_failed.code)}"
        else:  # stopped when node 0's service went away: the failure was there
            code, what = exitcodes.EXIT_PEER_LOST, "its processes were stopped"
        silent = sorted({q for note in notes.values() for q in note.get("silent") or [] if isinstance(q, int)})
        report = reports.Report(self.config.node_rank, attempt, code, what, tuple(silent))
        reports.send(reports.address(net.split_address(self.config.coordinator)), report, self.token)

    def linger(self, attempt: int, interrupted: Callable[[], bool]) -> None:
        """After a failure of this node's own, keeps the service up while the other nodes' processes find it by
        themselves: without it they would only see the coordinator gone, not which process failed. Ends early once
        every other node's launcher has reported its end (or at a signal: ``interrupted``)."""

        def all_reported() -> bool:
            return self.reports is not None and len(self.reports.reports(attempt)) == self.config.nnodes - 1

        if all_reported():
            return
        wait = (self.config.peer_timeout or config_lib.DEFAULT_PEER_TIMEOUT_S) + 5
        self.output.say(f"keeping the coordination service up {wait:g} s for the other nodes' processes to end")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and not interrupted():
            if all_reported():
                self.output.say("every other node's launcher reported its processes ended")
                return
            time.sleep(0.1)
