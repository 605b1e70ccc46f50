"""What the elastic rounds need of a launcher (``RoundLauncher``): the interface between ``elastic`` and ``supervisor``.

The rounds of ``--nnodes MIN:MAX`` (``jddp.cli.launch.elastic``) drive a fixed-membership launcher: each round is one
of its attempts with the round's nodes, node rank, first process id and number of processes. They hold the launcher
through this interface alone, as torch's elastic agent holds its workers through ``agent/server/api.py``; the
launcher of ``jddp.cli.launch.supervisor`` implements it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from jddp.cli.launch import config as config_lib
from jddp.cli.launch import rendezvous, workers


class RoundLauncher(Protocol):
    """A launcher that runs the rounds of an elastic run, one attempt each, on this node."""

    run_start: float  # the run's start (``JDDP_RUN_START``): node 0's, so that a successor of node 0 continues the run

    @property
    def config(self) -> config_lib.LaunchConfig:
        """The configuration of the round being run (before the first: the one the launcher was started with)."""
        ...

    @property
    def signal_received(self) -> int | None:
        """The signal the launcher received (SIGINT, SIGTERM, SIGHUP), if any: the run ends."""
        ...

    @property
    def attempt(self) -> int:
        """The number of the round running (the last one run, after it ended)."""
        ...

    @property
    def token(self) -> bytes:
        """The job's token (``jddp.cli.job_token``): the rendezvous admits only launchers that prove it."""
        ...

    def say(self, message: str) -> None:
        """Prints ``jddp launch: message`` on stderr."""
        ...

    def receive_reports(self, server: rendezvous.Server) -> None:
        """The other nodes' reports of a failed round arrive at ``server`` (node 0's rendezvous)."""
        ...

    def set_round(self, config: config_lib.LaunchConfig, membership: str | None) -> None:
        """The next round's configuration (its nodes, node rank, first process id and number of processes) and its
        membership for the processes (``JDDP_MEMBERSHIP``)."""
        ...

    def set_round_ahead(self, config: config_lib.LaunchConfig | None, membership: str = "") -> None:
        """The round that follows the one starting, where it is known ahead (its configuration and membership), for
        which this node's next processes stand by (``jddp.runtime.standby``); None: none is known."""
        ...

    def run_round(
        self, number: int, hook: Callable[[], tuple[str, workers.Worker | None] | None]
    ) -> tuple[str, workers.Worker | None]:
        """Runs round ``number`` as one attempt, calling ``hook`` at every check of its watch (the round ends with the
        outcome ``hook`` returns, if any); returns ("ok" | "failed" | "preempted" | "signal" | the hook's outcome,
        the first failed process)."""
        ...

    def first_step_taken(self) -> bool:
        """Whether the round's processes took their first step (fit's goodput ledger says so)."""
        ...

    def stop_for_restart(self) -> None:
        """Stops this node's processes at once: the round ends and another follows."""
        ...

    def stop_all(self, kill_grace: float) -> None:
        """Stops this node's processes: SIGTERM, SIGKILL after ``kill_grace`` seconds."""
        ...

    def signal_all(self, signum: int) -> None:
        """Sends ``signum`` to this node's processes (SIGTERM: the preemption save)."""
        ...

    def exit_code(self, outcome: str, first_failed: workers.Worker | None) -> int:
        """The launcher's exit code after the last round ended with ``outcome``."""
        ...
