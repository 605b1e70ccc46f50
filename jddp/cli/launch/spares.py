"""The spares and standby generations of this node (``jddp.cli.spare``, ``jddp.runtime.standby``): for each of the
next ``--standby-depth`` attempts, one spare per local process and (a local run) that attempt's coordination service,
started before a restart needs them and, on one node with the launcher's own coordinator, handed their roles in that
attempt at once to stand by there compiled.

Generations are prepared one at a time, nearest attempt first: a generation's spares start once every earlier one
stands by, so the CPU goes to the standby that the next failure needs. While a spare prepares (its imports, its
joining, its compilation) its autogroup nice value is ``--standby-nice`` (``AUTOGROUP``), and 0 again once it stands
by or is handed a role. A generation started while the attempt it waits behind still starts up (``early``: that
attempt had nothing behind it) is at ``EARLY_NICE`` until ``lift_early``."""

from __future__ import annotations

import dataclasses
import socket
import sys
import threading
import time
from collections.abc import Callable

from jddp import exitcodes
from jddp.cli import output
from jddp.cli import spare as spare_lib
from jddp.cli.launch import config as config_lib
from jddp.cli.launch import environment, service, snapshots, workers, zygote

STANDBY_READY = "standby process(es) of the next attempt ready: compiled, waiting before their restore"
SPARES_READY = "spare process(es) ready for a restart"
FORKED = "forked from the zygote"  # said after SPARES_READY of spares forked by jddp.cli.zygote
LATER_READY = "standby process(es) ready further ahead: compiled, waiting before their restore"
# How long a restart waits for a generation handed its standby roles that does not stand by yet (its processes all
# running): a bound for one stuck where it should not be; a standby process's whole preparation took 12 to 16 s at
# load 15 to 23 (issue 43), less than that once the failed group's CPUs are free.
STANDBY_WAIT_S = 30.0
# The scheduler's weight of a process started in a session of its own (as the launcher starts every process) is its
# session's autogroup's where autogroups are on (/proc/sys/kernel/sched_autogroup_enabled, the task in the root CPU
# cgroup): its own nice value and SCHED_IDLE then change nothing against the other sessions' processes (measured
# here: two busy loops on one core, 50/50 with one at nice 19 or SCHED_IDLE, 98.6/1.4 with its autogroup at nice 19).
# Unlike a nice value or SCHED_IDLE, an autogroup's nice goes back to 0 without privilege (the kernel asks
# RLIMIT_NICE only below 0), at most one write per 100 ms per host (EAGAIN; CAP_SYS_ADMIN is exempt): checked as
# uid nobody with RLIMIT_NICE 0 (setpriv), where a nice value and SCHED_IDLE could not be undone (EACCES, EPERM).
AUTOGROUP = "/proc/{pid}/autogroup"
EARLY_NICE = 19  # a generation started during its attempt's start-up (``SparePool.lift_early`` ends it)


def same_round(ahead: config_lib.LaunchConfig | None, config: config_lib.LaunchConfig) -> bool:
    """Whether a generation handed the roles of round ``ahead`` (None: not elastic) serves ``config``'s processes."""
    if ahead is None:
        return True
    fields = ("nnodes", "node_rank", "process_offset", "world", "nprocs")
    return all(getattr(ahead, f) == getattr(config, f) for f in fields)


def set_autogroup_nice(pid: int, nice: int) -> bool:
    """Sets process ``pid``'s autogroup nice value; False when it must be tried again (the host's rate limit for the
    unprivileged), True when done or impossible (no autogroups here, the process gone)."""
    try:
        with open(AUTOGROUP.format(pid=pid), "w") as f:
            f.write(str(nice))
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


@dataclasses.dataclass
class Generation:
    """The spares of one future attempt (by local rank) and, on a local run, that attempt's coordination service."""

    attempt: int
    service: service.Service | None
    spares: dict[int, spare_lib.Spare]
    said_ready: bool = False  # every spare finished its imports (said once, for the nearest generation)
    handed: bool = False  # its spares were handed their standby roles in ``attempt``
    said: bool = False  # the launcher said that it stands by, or that one of it ended before
    round: config_lib.LaunchConfig | None = None  # an elastic round known ahead, whose roles it was handed (``ahead``)
    handed_at: float | None = None  # time.monotonic() when its roles were handed

    def standing_by(self, nprocs: int) -> bool:
        """Whether every local process of ``attempt`` stands by, and its service still runs."""
        spares = self.spares.values()
        return (
            self.handed
            and self.service is not None
            and self.service.popen.poll() is None
            and len(self.spares) == nprocs
            and all([s.standing_by() for s in spares])  # a list: each reads its message
        )


class SparePool:
    """The generations by attempt, nearest first.

    ``role_environment(local_rank, coordinator, attempt[, ahead])`` is the environment of a process's role
    (``jddp.cli.launch.environment.role_environment`` with the run's own settings; with ``ahead``, an elastic round's
    configuration and membership known ahead, that round's); ``services`` starts and stops the generations'
    coordination services.
    """

    def __init__(
        self,
        config: config_lib.LaunchConfig,
        out: output.Output,
        snapshot_dir: snapshots.SnapshotDir,
        role_environment: Callable[..., dict[str, str]],
        services: service.ServiceManager | None = None,
    ) -> None:
        self.config = config
        self.output = out
        self.snapshot_dir = snapshot_dir
        self.role_environment = role_environment
        self.stands_by_nowhere = False  # a generation was waited for in vain: the script stands by nowhere
        self.services = services if services is not None else service.ServiceManager(config)
        self.generations: list[Generation] = []
        self.renice: dict[int, int] = {}  # pid -> the autogroup nice value still to write (the rate limit)
        self.early: set[int] = set()  # spares lowered to EARLY_NICE while the attempt they wait behind starts
        self.zygote: zygote.Zygote | None = None  # forks imported spares (``open_zygote``)
        # An elastic run's next round where it is known ahead (node 0 of two nodes, MIN 1: the round of this node
        # alone, should the other be lost): its configuration and membership, which a generation stands by for.
        self.ahead: tuple[config_lib.LaunchConfig, str] | None = None

    def open_zygote(self) -> None:
        """Starts this node's zygote (``jddp.cli.launch.zygote``) where forked spares serve the run: when the first
        generation is wanted (``prepare``), not with the first attempt, whose start-up has the CPUs to itself."""
        c = self.config
        if self.zygote is not None or not zygote.usable(c):
            return
        env = environment.base_environment(c)
        if self.snapshot_dir.path is not None:
            env[environment.ENV_SNAPSHOT_DIR] = self.snapshot_dir.path
        self.zygote = zygote.Zygote()
        self.zygote.start(env)

    def close_zygote(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None

    def forked(self, local_rank: int) -> spare_lib.Spare | None:
        """A spare of process ``local_rank`` forked now from the zygote (imported from its first instant), or None
        when the zygote is not ready."""
        if self.zygote is None or not self.zygote.ready():
            return None
        return self._new(local_rank, early=False, fork_only=True)

    def start(self, local_rank: int, early: bool = False) -> spare_lib.Spare:
        """Starts the spare of process ``local_rank`` (not kept: see ``prepare``), forked from the zygote when it is
        ready, else a process of its own; its autogroup lowered to ``--standby-nice`` while it prepares (to
        ``EARLY_NICE`` when ``early``: until ``lift_early``)."""
        spare = self._new(local_rank, early=early, fork_only=False)
        assert spare is not None  # started as a process of its own when not forked
        return spare

    def _new(self, local_rank: int, *, early: bool, fork_only: bool) -> spare_lib.Spare | None:
        env = environment.base_environment(self.config)
        if self.snapshot_dir.path is not None:
            env[environment.ENV_SNAPSHOT_DIR] = self.snapshot_dir.path
        cores = environment.cores(self.config, local_rank, env)
        prefix = output.Prefix(f"[spare {local_rank}] ".encode())  # a spare prints nothing before its role
        forked = self.zygote.fork(self.output, cores, prefix) if self.zygote is not None else None
        if forked is not None:
            popen, readers, stdout_fd, ours = forked
        elif fork_only:
            return None
        else:
            ours, theirs = socket.socketpair()
            argv = [sys.executable, "-u", "-m", "jddp.cli.spare", str(theirs.fileno())]
            try:
                popen, readers, stdout_fd = workers.spawn(
                    self.output, argv, env, cores, prefix, pass_fds=(theirs.fileno(),)
                )
            finally:
                theirs.close()
        if early:
            self.early.add(popen.pid)
            self.set_nice(popen.pid, EARLY_NICE)
        elif self.config.standby_nice:
            self.set_nice(popen.pid, self.config.standby_nice)
        return spare_lib.Spare(local_rank, popen, ours, prefix, readers, stdout_fd)

    # -- priority ---------------------------------------------------------------------------------------------------
    def set_nice(self, pid: int, nice: int) -> None:
        """Writes ``pid``'s autogroup nice value now, or at the next ``poll`` when the host's rate limit refuses."""
        self.renice.pop(pid, None)
        if not set_autogroup_nice(pid, nice):
            self.renice[pid] = nice

    def restore(self, spare: spare_lib.Spare) -> None:
        """The spare's autogroup back at nice 0 (it stands by, or is given a role: it trains next)."""
        if self.config.standby_nice or spare.popen.pid in self.early:
            self.early.discard(spare.popen.pid)
            self.set_nice(spare.popen.pid, 0)

    def lift_early(self) -> None:
        """The spares lowered to ``EARLY_NICE`` back at ``--standby-nice`` (the attempt they waited behind is past
        its start-up)."""
        for pid in list(self.early):
            self.set_nice(pid, self.config.standby_nice)
        self.early.clear()

    def retry_renice(self) -> None:
        for pid, nice in list(self.renice.items()):
            if set_autogroup_nice(pid, nice):
                del self.renice[pid]

    # -- generations ------------------------------------------------------------------------------------------------
    def standby_possible(self) -> bool:
        c = self.config
        alone = c.nnodes == 1 and c.coordinator is None
        return c.spares and c.standby and (alone or self.ahead is not None) and c.transport == "xla"

    def depth(self, attempt: int) -> int:
        """How many generations to keep while attempt ``attempt`` runs: ``--standby-depth`` with standby, one
        otherwise (spares wait for a role at their imports, whatever attempt it is), never past the last attempt
        (``--max-restarts``; an elastic run's rounds have no last)."""
        c = self.config
        depth = c.standby_depth if self.standby_possible() else 1
        if c.elastic:  # one round known ahead at most (``ahead``), else spares at their imports
            return 1
        return max(0, min(depth, c.max_restarts - attempt))

    def prepare(self, attempt: int, early: bool = False) -> None:
        """Starts the nearest missing generation while attempt ``attempt`` runs, once every earlier one stands by
        (or, without standby, none is kept): its service (a local run: a fresh free port of loopback) and one spare
        per local process."""
        c = self.config
        if len(self.generations) >= self.depth(attempt):
            return
        if any(not g.standing_by(c.nprocs) for g in self.generations):
            return
        self.open_zygote()
        if self.zygote is not None and self.zygote.pending():  # its spares will be forked, imported, in a moment
            return
        local = c.node_rank == 0 and (c.coordinator is None or self.ahead is not None)
        upcoming = self.generations[-1].attempt + 1 if self.generations else attempt + 1
        next_service = self.services.spawn_local() if local else None
        spares = {rank: self.start(rank, early) for rank in range(c.nprocs)} if c.spares else {}
        self.generations.append(Generation(upcoming, next_service, spares))

    def next_standing_by(self) -> bool:
        """Whether the nearest generation stands by (a failure now would find its attempt ready)."""
        return bool(self.generations) and self.generations[0].standing_by(self.config.nprocs)

    def take(self, attempt: int) -> Generation | None:
        """The generation prepared for attempt ``attempt``, no longer kept here, or None (those of earlier attempts
        are ended). Spares that wait at their imports serve any attempt."""
        while self.generations:
            generation = self.generations.pop(0)
            if not generation.handed:
                return generation
            if generation.attempt == attempt and same_round(generation.round, self.config):
                return generation
            ahead = generation.round
            if generation.attempt == attempt and ahead is not None:  # an elastic round known ahead that did not come
                self.output.say(
                    f"the standby process(es) of round {attempt} were prepared for {ahead.nnodes} node(s), "
                    f"{ahead.world} process(es), not this round's: ending them, starting its processes anew"
                )
            self.end(generation)
        return None

    def poll(self) -> None:
        """Says once when the nearest generation's spares finished their imports, hands every ready generation its
        standby roles (its service listens), says when one stands by (or that one of it ended first), restores the
        priority of those standing by."""
        self.retry_renice()
        for number, generation in enumerate(self.generations):
            spares = generation.spares
            if spares and not generation.said_ready and all(s.ready() for s in spares.values()):
                generation.said_ready = True
                if number == 0:
                    forked = all(isinstance(s.popen, zygote.Forked) for s in spares.values())
                    self.output.say(f"{len(spares)} {SPARES_READY}" + (f" ({FORKED})" if forked else ""))
            if generation.said_ready:
                self.hand_standby(generation)
            if generation.handed and not generation.said:
                self.say_standing(generation, number)

    def say_standing(self, generation: Generation, number: int) -> None:
        if generation.standing_by(self.config.nprocs):
            generation.said = True
            for spare in generation.spares.values():
                self.restore(spare)
            n = len(generation.spares)
            self.output.say(
                f"{n} {STANDBY_READY} ({generation.attempt})"
                if number == 0
                else f"{n} {LATER_READY} (attempt {generation.attempt}, {number + 1} failures ahead)"
            )
            return
        for spare in generation.spares.values():
            code = spare.popen.poll()
            if spare.standby and not spare.said_standing_by and code is not None:
                generation.said = True  # a restart now starts its processes anew: start() says so
                self.output.say(
                    f"the standby process for process {spare.prefix.value.decode().strip(' []')} of attempt "
                    f"{generation.attempt} ended before it stood by ({exitcodes.describe(code)}); "
                    "what it printed follows"
                )
                self.output.release(spare.prefix)

    def hand_standby(self, generation: Generation) -> None:
        """Once every spare of ``generation`` is ready and its service listens: each spare becomes its process of
        the generation's attempt, in standby (``jddp.runtime.standby``)."""
        next_service = generation.service
        if generation.handed or not self.standby_possible() or next_service is None:
            return
        if not next_service.ready.is_set() or len(generation.spares) != self.config.nprocs:
            return
        generation.handed = True
        generation.handed_at = time.monotonic()
        c, ahead = self.config, self.ahead
        if ahead is not None:  # an elastic round known ahead: its processes, its membership
            c, generation.round = ahead[0], ahead[0]
        for local_rank, spare in generation.spares.items():
            where = (local_rank, next_service.coordinator, generation.attempt)
            env = self.role_environment(*where) if ahead is None else self.role_environment(*where, ahead)
            env[environment.ENV_STDOUT_FD] = str(spare.stdout_fd)
            message = spare_lib.role(env, module=c.module, target=c.target, args=c.target_args, standby=True)
            spare.hand(message, int(env["JDDP_PROCESS_ID"]), standby=True)  # one that ended is found at the restart

    def await_standing_by(self, generation: Generation, stop: Callable[[], bool]) -> None:
        """At its attempt's start: a generation handed its standby roles whose processes all still run but not all
        stand by yet (still joining, building or compiling) is waited for, up to ``STANDBY_WAIT_S`` (or until
        ``stop()``): what they have left is less than what processes started anew would do (Python's start, the
        imports, the joining, the compilation), and the failed group's CPUs are theirs now. The bound counts from
        the roles' handing, not from the failure: a generation that has prepared for that long stands by nowhere (a
        script that never reaches ``standby.wait``: no ``fit``, ``Checkpointer.restore_or_init`` or jddp step), and
        once one was waited for in vain no later generation of the run is (``stands_by_nowhere``)."""
        nprocs = self.config.nprocs
        if not generation.handed or generation.standing_by(nprocs) or not self.alive(generation):
            return
        left = STANDBY_WAIT_S - (time.monotonic() - (generation.handed_at or time.monotonic()))
        if self.stands_by_nowhere or left <= 0:
            return
        waiting = sum(not s.standing_by() for s in generation.spares.values())
        self.output.say(
            f"{waiting} standby process(es) of attempt {generation.attempt} still preparing: waiting for them up to "
            f"{left:.0f} s more (less than processes started anew need)"
        )
        deadline = time.monotonic() + left
        while time.monotonic() < deadline and not stop() and self.alive(generation):
            if generation.standing_by(nprocs):
                return
            time.sleep(0.01)
        if not stop() and self.alive(generation):  # alive, prepared for STANDBY_WAIT_S, and not standing by
            self.stands_by_nowhere = True

    def alive(self, generation: Generation) -> bool:
        """Whether every process of ``generation`` and its service still run."""
        service_runs = generation.service is not None and generation.service.popen.poll() is None
        return service_runs and all(s.popen.poll() is None for s in generation.spares.values())

    def standby_failed(self, generation: Generation) -> bool:
        """At its attempt's start: whether ``generation`` was handed its standby roles but not every one stands by
        (it says so; the caller ends it)."""
        if not generation.handed or generation.standing_by(self.config.nprocs):
            return False
        if not generation.said:  # one that ended since the last poll: said, with what it printed
            self.say_standing(generation, 0)
        standing = sum(s.standing_by() for s in generation.spares.values())
        self.output.say(
            f"{standing} of {self.config.nprocs} standby process(es) stood by at the failure: ending them, starting "
            "the processes anew"
        )
        return True

    def end(self, generation: Generation, draining: list[threading.Thread] | None = None) -> None:
        """Ends ``generation``'s spares and its service (in the background); their output readers go to
        ``draining`` (to join when the launcher ends)."""
        for spare in generation.spares.values():
            self.renice.pop(spare.popen.pid, None)
            spare.discard()
            if draining is not None:
                draining += spare.readers
        generation.spares = {}
        if generation.service is not None:
            self.services.discard(generation.service)
            generation.service = None

    def discard(self) -> list[threading.Thread]:
        """Ends every generation; returns the readers of their output (to join when the launcher ends)."""
        readers: list[threading.Thread] = []
        generations, self.generations = self.generations, []
        for generation in generations:
            self.end(generation, readers)
        self.renice.clear()
        return readers
