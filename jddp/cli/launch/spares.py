"""The spares of this node (``jddp.cli.spare``): one per local process, started with the imports done before a
restart needs them, and, on one node with the launcher's own coordinator, handed their roles in the next attempt
at once to stand by there compiled (``jddp.runtime.standby``)."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Callable

from jddp import exitcodes
from jddp.cli import output
from jddp.cli import spare as spare_lib
from jddp.cli.launch import config as config_lib
from jddp.cli.launch import environment, service, snapshots, workers

STANDBY_READY = "standby process(es) of the next attempt ready: compiled, waiting before their restore"


class SparePool:
    """The spares by local rank, and what was said and done of them in this attempt.

    ``role_environment(local_rank, coordinator, attempt)`` is the environment of a process's role
    (``jddp.cli.launch.environment.role_environment`` with the run's own settings).
    """

    def __init__(
        self,
        config: config_lib.LaunchConfig,
        out: output.Output,
        snapshot_dir: snapshots.SnapshotDir,
        role_environment: Callable[[int, str, int], dict[str, str]],
    ) -> None:
        self.config = config
        self.output = out
        self.snapshot_dir = snapshot_dir
        self.role_environment = role_environment
        self.spares: dict[int, spare_lib.Spare] = {}  # by local rank: waiting for a restart's role
        self.said_ready = False
        self.standby_handed = False  # this attempt's spares were handed their roles in the next attempt
        self.standby_said = False

    def start(self, local_rank: int) -> spare_lib.Spare:
        """Starts the spare of process ``local_rank`` (not kept: see ``fill``)."""
        env = environment.base_environment(self.config)
        if self.snapshot_dir.path is not None:
            env[environment.ENV_SNAPSHOT_DIR] = self.snapshot_dir.path
        cores = environment.cores(self.config, local_rank, env)
        ours, theirs = socket.socketpair()
        prefix = output.Prefix(f"[spare {local_rank}] ".encode())  # a spare prints nothing before its role
        argv = [sys.executable, "-u", "-m", "jddp.cli.spare", str(theirs.fileno())]
        try:
            popen, readers, stdout_fd = workers.spawn(
                self.output, argv, env, cores, prefix, pass_fds=(theirs.fileno(),)
            )
        finally:
            theirs.close()
        return spare_lib.Spare(local_rank, popen, ours, prefix, readers, stdout_fd)

    def fill(self) -> None:
        """One spare per local process: starts those missing."""
        for local_rank in range(self.config.nprocs):
            if local_rank not in self.spares:
                self.spares[local_rank] = self.start(local_rank)

    def take(self, local_rank: int) -> spare_lib.Spare | None:
        """The spare of process ``local_rank``, no longer kept here, or None."""
        return self.spares.pop(local_rank, None)

    def poll(self, next_service: service.Service | None, attempt: int) -> None:
        """Says once when every spare finished its imports, then hands them their standby roles in attempt
        ``attempt + 1`` (served by ``next_service``)."""
        if self.spares and not self.said_ready and all(s.ready() for s in self.spares.values()):
            self.said_ready = True
            self.output.say(f"{len(self.spares)} spare process(es) ready for a restart")
        if self.said_ready:
            self.hand_standby(next_service, attempt)
        if self.standby_handed and not self.standby_said:
            if self.standing_by(next_service):
                self.standby_said = True
                self.output.say(f"{len(self.spares)} {STANDBY_READY}")
            for spare in self.spares.values():
                if spare.standby and not spare.said_standing_by and spare.popen.poll() is not None:
                    self.standby_said = True  # a restart now starts its processes anew: start() says so
                    self.output.say(
                        f"the standby process for process {spare.prefix.value.decode().strip(' []')} ended before "
                        f"it stood by ({exitcodes.describe(spare.popen.returncode)}); what it printed follows"
                    )
                    self.output.release(spare.prefix)

    def standby_possible(self) -> bool:
        c = self.config
        return c.spares and c.standby and c.nnodes == 1 and c.coordinator is None and c.transport == "xla"

    def hand_standby(self, next_service: service.Service | None, attempt: int) -> None:
        """Once every spare is ready and the next service listens: each spare becomes its process of the next
        attempt, in standby (``jddp.runtime.standby``)."""
        if self.standby_handed or not self.standby_possible() or next_service is None:
            return
        if not next_service.ready.is_set() or len(self.spares) != self.config.nprocs:
            return
        self.standby_handed = True
        c = self.config
        for local_rank, spare in self.spares.items():
            env = self.role_environment(local_rank, next_service.coordinator, attempt + 1)
            env[environment.ENV_STDOUT_FD] = str(spare.stdout_fd)
            message = spare_lib.role(env, module=c.module, target=c.target, args=c.target_args, standby=True)
            spare.hand(message, int(env["JDDP_PROCESS_ID"]), standby=True)  # one that ended is found at the restart

    def standing_by(self, next_service: service.Service | None) -> bool:
        """Whether every local process of the next attempt stands by, and their service still runs."""
        spares = self.spares.values()
        return (
            next_service is not None
            and next_service.popen.poll() is None
            and len(self.spares) == self.config.nprocs
            and all(s.standby for s in spares)
            and all([s.standing_by() for s in spares])  # a list: each reads its message
        )

    def standby_failed(self, next_service: service.Service | None) -> bool:
        """At the next attempt's start: whether spares were handed their standby roles but not every one stands by
        (it says so; the caller ends them and their service)."""
        if not self.standby_handed or self.standing_by(next_service):
            return False
        standing = sum(s.standing_by() for s in self.spares.values())
        self.output.say(
            f"{standing} of {self.config.nprocs} standby process(es) stood by at the failure: ending them, starting "
            "the processes anew"
        )
        return True

    def discard(self) -> list[threading.Thread]:
        """Ends every spare; returns the readers of their output (to join when the launcher ends)."""
        spares, self.spares = self.spares, {}
        readers: list[threading.Thread] = []
        for spare in spares.values():
            spare.discard()
            readers += spare.readers
        return readers
