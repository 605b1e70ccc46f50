"""The attempt loop: start the group, watch it until it ends, restart it after a failure (``Launcher``), and the
entry points ``launch`` and ``main``."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from types import FrameType

from jddp import envvars, exitcodes, net
from jddp.cli import job_token, output
from jddp.cli import spare as spare_lib
from jddp.cli.launch import config as config_lib
from jddp.cli.launch import (
    elastic,
    environment,
    failure,
    mpi,
    nodes,
    notes,
    rendezvous,
    service,
    snapshots,
    spares,
    workers,
)

STARTED = time.time()  # the run's start for the goodput ledger (jddp.goodput): the launcher's own included
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# With a restart left: how long after an attempt's start the spares and the next coordination service start when
# the processes' goodput ledger does not say earlier that they are past their first step (a script without fit). An
# attempt woken from standby prepares the next generation at once unless the next attempt stands by already, and
# any attempt with no generation behind it starts one at once, lowered (``Launcher.prepare_restart``).
PREPARE_AFTER_S = 3.0


class Launcher:
    """One launcher's group of processes across its attempts, composed of its parts: the processes (``group``),
    the coordination service (``services``), the spares (``spares``), the other nodes (``nodes``), the processes'
    notes (``notes``) and the snapshot directory (``snapshot_dir``). It runs the rounds of an elastic run as
    ``api.RoundLauncher``."""

    def __init__(self, config: config_lib.LaunchConfig) -> None:
        self.config = config
        self.output = output.Output()
        self.signal_received: int | None = None
        self.attempt_start = self.run_start = STARTED
        self.previous_end: float | None = None
        self.attempt = 0
        self.group = workers.WorkerGroup(self.output, config.flush_grace)
        self.services = service.ServiceManager(config)
        self.nodes = nodes.Nodes(config, self.output)
        self.notes = notes.NoteDir()
        self.snapshot_dir = snapshots.SnapshotDir()  # made by run() unless the user set one
        self.spares = spares.SparePool(config, self.output, self.snapshot_dir, self.role_environment, self.services)
        # Elastic runs (jddp.cli.launch.elastic): called at every check of the watch, ends the round when it returns
        # an outcome; the round's membership for the processes (JDDP_MEMBERSHIP).
        self.round_hook: Callable[[], tuple[str, workers.Worker | None] | None] | None = None
        self.membership: str | None = None
        self.token = b""  # the job's (jddp.cli.job_token), resolved by ``run``

    def set_config(self, config: config_lib.LaunchConfig) -> None:
        """An elastic round's configuration (its nodes, node rank and process ids), for every part."""
        self.config = self.services.config = self.nodes.config = self.spares.config = config

    # -- the rounds of an elastic run (jddp.cli.launch.elastic): api.RoundLauncher ------------------------------
    def say(self, message: str) -> None:
        self.output.say(message)

    def receive_reports(self, server: rendezvous.Server) -> None:
        self.nodes.reports = server

    def set_round(self, config: config_lib.LaunchConfig, membership: str | None) -> None:
        self.set_config(config)
        self.membership = membership

    def run_round(
        self, number: int, hook: Callable[[], tuple[str, workers.Worker | None] | None]
    ) -> tuple[str, workers.Worker | None]:
        self.round_hook = hook
        ended = self.run_once(number)
        self.round_hook = None
        return ended

    def set_round_ahead(self, config: config_lib.LaunchConfig | None, membership: str = "") -> None:
        self.spares.ahead = None if config is None else (config, membership)

    def first_step_taken(self) -> bool:
        return self.notes.first_step_taken(self.attempt_start)

    def stop_for_restart(self) -> None:
        self.group.stop_for_restart()

    def stop_all(self, kill_grace: float) -> None:
        self.group.stop_all(kill_grace)

    def signal_all(self, signum: int) -> None:
        self.group.signal_all(signum)

    def restart_follows(self) -> bool:
        """Whether the group starts again after this attempt fails: a restart is left, or the run is elastic (the
        rendezvous forms the next round, or ends the run)."""
        return self.config.elastic or self.attempt < self.config.max_restarts

    # -- one process's start --------------------------------------------------
    def role_environment(
        self, local_rank: int, coordinator: str, attempt: int, ahead: tuple[config_lib.LaunchConfig, str] | None = None
    ) -> dict[str, str]:
        """The environment of process ``local_rank`` of attempt ``attempt`` (``environment.role_environment``); with
        ``ahead``, of that elastic round's configuration and membership (``set_round_ahead``)."""
        config, membership = ahead if ahead is not None else (self.config, self.membership)
        env = environment.role_environment(
            config,
            local_rank,
            coordinator,
            attempt,
            run_start=self.run_start,
            ledger_note=self.notes.ledger,
            snapshot_dir=self.snapshot_dir.path,
            membership=membership,
        )
        env[job_token.ENV] = self.token.decode()
        return env

    def start_one(
        self, local_rank: int, coordinator: str, attempt: int, generation: spares.Generation | None
    ) -> workers.Worker:
        """Process ``local_rank``: woken from standby, handed to its spare, or started anew."""
        moment = environment.moment_environment(self.attempt_start, self.previous_end)
        spare = generation.spares.pop(local_rank, None) if generation is not None else None
        how = "handed"
        if spare is None and attempt > 0:  # none prepared: one forked now is imported already (jddp.cli.zygote)
            spare, how = self.spares.forked(local_rank), "forked"
        if spare is not None:
            self.spares.restore(spare)  # it trains next: its autogroup back at nice 0
        if spare is not None and spare.standby:  # standing by as this very process (start checked)
            process_id = self.config.first_process_id() + local_rank
            spare.wake(spare_lib.wake(moment), self.output)  # one that ended as it was woken: this attempt fails
            handle = workers.pidfd(spare.popen.pid)
            return workers.Worker(process_id, spare.popen, spare.readers, from_spare="woken", pidfd=handle)
        env = self.role_environment(local_rank, coordinator, attempt) | moment
        cores = environment.cores(self.config, local_rank, env)
        process_id = int(env["JDDP_PROCESS_ID"])
        if spare is not None:  # the same environment, with the spare's own pipe for Python's stdout
            c = self.config
            message = spare_lib.role({**env, environment.ENV_STDOUT_FD: str(spare.stdout_fd)}, module=c.module,
                                     target=c.target, args=c.target_args)  # fmt: skip
            if spare.hand(message, process_id):
                handle = workers.pidfd(spare.popen.pid)
                return workers.Worker(process_id, spare.popen, spare.readers, from_spare=how, pidfd=handle)
            self.group.draining += spare.readers
            self.output.say(f"the spare for process {process_id} had ended: starting the process anew")
        argv, prefix = config_lib.command(self.config), output.Prefix(f"[{process_id}] ".encode())
        popen, readers, _ = workers.spawn(self.output, argv, env, cores, prefix)
        return workers.Worker(process_id, popen, readers, pidfd=workers.pidfd(popen.pid))

    # -- an attempt -------------------------------------------------------------
    def start(self, attempt: int) -> None:
        c = self.config
        # the goodput ledger's start of this attempt (JDDP_ATTEMPT_START); the first one starts with the launcher
        self.attempt_start = STARTED if attempt == 0 else time.time()
        self.notes.clear()
        for w in self.group.workers:  # the previous attempt's
            if w.pidfd is not None:
                os.close(w.pidfd)
        generation = self.spares.take(attempt)
        if generation is not None:
            self.spares.await_standing_by(generation, lambda: self.signal_received is not None)
        if generation is not None and self.spares.standby_failed(generation):
            self.spares.end(generation, self.group.draining)  # the ended standby processes had joined its service
            generation = None
        coordinator = None
        if c.node_rank == 0 and generation is not None:
            coordinator = self.services.adopt(generation.service)
            generation.service = None
        if coordinator is None:
            coordinator = c.coordinator or f"127.0.0.1:{net.free_port()}"
            if c.node_rank == 0:
                self.services.start(coordinator)
        self.group.workers = [
            self.start_one(local_rank, coordinator, attempt, generation) for local_rank in range(c.nprocs)
        ]
        if generation is not None:  # spares of ranks this node no longer has
            self.spares.end(generation, self.group.draining)
        if c.node_rank == 0:
            try:
                self.services.await_ready()
            except OSError:
                self.group.signal_all(signal.SIGKILL)  # they would wait for a service that is not coming
                self.group.wait_all(30)
                self.group.finish_output()
                raise
        started = self.group.workers
        first, last = started[0].process_id, started[-1].process_id
        self.output.say(
            f"started processes {first}..{last} of {c.num_processes()} ("
            + (f"round {attempt}" if c.elastic else f"attempt {attempt + 1} of {c.max_restarts + 1}")
            + f", coordinator {coordinator}): {' '.join(config_lib.command(c)[1:])}"
        )
        for kind, how in (
            ("handed", "handed to their spares, not started anew"),
            ("forked", "handed to spares forked now from the zygote (imported), not started anew"),
            ("woken", "woken from standby"),
        ):
            handed = [w for w in started if w.from_spare == kind]
            if handed:
                said = ", ".join(f"{w.process_id} (pid {w.popen.pid})" for w in handed)
                self.output.say(f"process(es) {said} {how}")

    def prepare_restart(self) -> None:
        """With a restart left: prepares the next attempts' generations (``spares.SparePool.prepare``: their
        coordination services and spares, standing by where possible), so that a restart waits for neither. An
        attempt woken from standby does so at once when the next attempt has no standby yet (its own processes
        import and compile nothing). Any other attempt with no generation behind it at all starts one at once too,
        its spares' autogroups at ``spares.EARLY_NICE``: a failure within its first seconds would otherwise start
        every process anew (Python, the imports, the compilation: 2.7 to 3.2 s from the kill to the next first
        step on a 2-core VM, against 1.7 s handed to those spares; ``benchmarks/chaos.py``, 29 Nov 2026), and
        lowered they take only what the attempt's start-up leaves idle. Every attempt prepares at full priority,
        and lifts those lowered, once its processes are past their first step (or ``PREPARE_AFTER_S`` after its
        start): their start-up, or the woken processes' restore and first step, need the CPUs more before."""
        c = self.config
        if not self.restart_follows() or c.transport != "xla":
            return
        woken = any(w.from_spare == "woken" for w in self.group.workers)
        covered = self.spares.next_standing_by()
        early = time.time() - self.attempt_start < PREPARE_AFTER_S and not self.first_step_taken()
        if not early:
            self.spares.lift_early()
            self.spares.prepare(self.attempt)
        elif woken and not covered:
            self.spares.prepare(self.attempt)
        elif not self.spares.generations:
            self.spares.prepare(self.attempt, early=True)

    def silent_named(self) -> None:
        """Acts on the processes' notes of silent peers (``WorkerGroup.stop_silent``); node 0 of several tells the
        other launchers of those that are theirs, and the others stop those node 0 told them of."""
        here = {w.process_id for w in self.group.workers}
        for p, note in sorted(self.notes.read().items()):
            silent = {q for q in note.get("silent") or [] if isinstance(q, int)}
            if silent & {w.process_id for w in self.group.workers if w.code is None}:
                self.group.stop_silent(silent, f"process {p}")
            self.nodes.tell_silent(self.attempt, silent - here)
        told = self.nodes.silent_elsewhere(self.attempt)
        if told & {w.process_id for w in self.group.workers if w.code is None}:
            self.group.stop_silent(told, "a process of node 0")

    def wait_silent(self, timeout: float) -> bool:
        """``WorkerGroup.wait_all``, stopping at once the processes that a survivor names silent meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.silent_named()
            if self.group.wait_all(min(0.2, max(deadline - time.monotonic(), 0.0))):
                return True
        self.group.poll()
        return all(w.code is not None for w in self.group.workers)

    def first_failure(self) -> workers.Worker | None:
        return failure.first_failure(self.group.workers)

    def failed_here(self, first_failed: workers.Worker) -> tuple[str, workers.Worker | None]:
        """A process of this node failed first: stops the others at once when a restart follows, else gives them
        the time to end by themselves (each naming what it lost, exit 69) before it stops them."""
        assert first_failed.code is not None  # first_failure picks among processes that exited
        what = exitcodes.describe(first_failed.code)
        if first_failed.code == 0:
            what = "exited 0 while its peers still needed it (it returned early or called sys.exit(0))"
        # The others end by themselves within the peer timeout, each naming what it lost (exit 69); signals only
        # for those that do not. When the first to end lost a peer, the others that lost it judge the same
        # silence and end within a watchdog round; whoever is still running after that is the frozen one.
        if self.restart_follows() and not exitcodes.is_peer_failure(first_failed.code):
            self.output.say(f"process {first_failed.process_id} {what}; a restart follows: stopping the others")
            self.group.stop_for_restart()
            return "failed", first_failed
        wait = (self.config.peer_timeout or config_lib.DEFAULT_PEER_TIMEOUT_S) + 5
        if first_failed.code == exitcodes.EXIT_PEER_LOST:  # not SIGABRT: gloo aborts a process at once
            wait = failure.PEER_LOST_WAIT_S
        self.output.say(
            f"process {first_failed.process_id} {what}; waiting up to {wait:g} s for the others to end, "
            "then stopping them"
        )
        if not self.wait_silent(wait):
            self.group.stop_all(self.config.kill_grace)
        self.group.poll()
        return "failed", self.first_failure() or first_failed

    def watch(self) -> tuple[str, workers.Worker | None]:
        """Watches the started processes until they all ended; returns as ``run_once`` does."""
        group = self.group
        self.nodes.watch_start()
        while True:
            if self.signal_received is not None:
                group.stop_after_signal(self.signal_received, self.config.term_timeout)
                return "signal", None
            group.poll()
            if self.round_hook is not None:
                ended = self.round_hook()
                if ended is not None:
                    return ended
            self.silent_named()
            if self.nodes.remote_failure(self.attempt, group):
                return "failed", self.first_failure()
            if self.nodes.service_gone() and any(w.code is None for w in group.workers):
                self.output.say(
                    f"the coordination service at {self.config.coordinator} has not answered for "
                    f"{nodes.SERVICE_GONE_S:g} s: the group has ended on node 0; stopping this node's processes"
                )
                group.stop_all(self.config.kill_grace)
                group.poll()
                return "failed", self.first_failure()
            first_failed = self.first_failure()
            if first_failed is not None:
                return self.failed_here(first_failed)
            if all(w.code is not None for w in group.workers):
                group.finish_output()
                if any(w.code == exitcodes.EXIT_PREEMPTED for w in group.workers):
                    return "preempted", None
                early = [w for w in group.workers if self.notes.read().get(w.process_id, {}).get("early")]
                if early:  # exited 0, but its peers (on other nodes) stopped waiting for it: the run failed
                    return "failed", min(early, key=lambda w: w.ended or 0.0)
                return "ok", None
            self.prepare_restart()
            self.spares.poll()
            group.sleep(self.config.monitor_interval)

    def run_once(self, attempt: int) -> tuple[str, workers.Worker | None]:
        """Runs one attempt; returns ("ok" | "failed" | "preempted" | "signal", the first failed process)."""
        c = self.config
        try:
            self.start(attempt)
            self.attempt = attempt
            outcome, first_failed = self.watch()
            if outcome == "failed" and c.node_rank > 0:
                self.nodes.report(attempt, first_failed, self.notes.read())
            if (
                outcome == "failed"
                and self.services.current is not None
                and c.nnodes > 1
                and not c.elastic  # the rendezvous tells the others' launchers to stop their processes
                and first_failed is not None
                and not exitcodes.is_peer_failure(first_failed.code or 0)
            ):
                self.nodes.linger(attempt, lambda: self.signal_received is not None)
            return outcome, first_failed
        finally:
            # A local run's next service listens on another port: this one stops in the background.
            self.services.stop(wait=c.coordinator is not None)
            self.previous_end = time.time()

    # -- signals ------------------------------------------------------------
    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No printing here: the handler may interrupt `say`, which holds the output lock.
        if self.signal_received is not None:
            self.group.signal_all(signal.SIGKILL)
            return
        self.signal_received = signum
        self.group.signal_all(signum)

    # -- the run ------------------------------------------------------------
    def summary(self, first_failed: workers.Worker | None) -> str:
        return failure.summary(
            self.group.workers, first_failed, self.notes.read(), lambda: self.nodes.reported(self.attempt)
        )

    def exit_code(self, outcome: str, first_failed: workers.Worker | None) -> int:
        """The launcher's exit code after the last attempt ended with ``outcome`` (``failure.exit_code``)."""
        code, said = failure.exit_code(
            outcome,
            first_failed,
            self.group.workers,
            signal_received=self.signal_received,
            max_restarts=self.config.max_restarts,
            summarize=self.summary,
        )
        if said is not None:
            self.output.say(said)
        return code

    def run(self) -> int:
        c = self.config
        try:
            user_snapshot_dir = envvars.get(environment.ENV_SNAPSHOT_DIR)  # the user's own, if set
        except ValueError as error:
            self.output.say(str(error))
            return 1
        try:
            self.token, source = job_token.resolve(
                nnodes=c.max_nodes or c.nnodes, coordinator=c.coordinator, token_file=c.job_token_file
            )
        except ValueError as error:
            self.output.say(str(error))
            return 1
        if c.nnodes > 1 or c.elastic:
            self.output.say(f"job token: from {source} (only launchers that prove it are heard)")
        try:
            self.nodes.open(self.token)
        except OSError as error:
            self.output.say(str(error))
            return 1
        previous = {s: signal.signal(s, self.on_signal) for s in FORWARDED_SIGNALS}
        try:
            self.snapshot_dir.open(user_snapshot_dir, self.output.say)
            if c.transport == "mpi":
                path = self.snapshot_dir.path
                return mpi.run_mpi(c, self.output, self.group, path, lambda: self.signal_received)
            if c.elastic:
                return elastic.run(self)
            attempt = 0
            while True:
                try:
                    outcome, first_failed = self.run_once(attempt)
                except OSError as error:  # the coordination service could not start (its workers were stopped)
                    self.output.say(str(error))
                    return 1
                if outcome == "failed" and attempt < c.max_restarts and self.signal_received is None:
                    attempt += 1
                    restarts = f"{attempt} of {c.max_restarts}"
                    self.output.say(f"{self.summary(first_failed)}\nrestarting the group ({restarts})")
                    continue
                return self.exit_code(outcome, first_failed)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            try:
                self.group.draining += self.spares.discard()  # and their services, started for restarts not come
                self.spares.close_zygote()
                self.services.join()
                for thread in self.group.draining:
                    thread.join(timeout=10)
                self.group.close()
            finally:
                # The run's account ends here (goodput's teardown): after the spares, the services and the output
                # threads are stopped, which took about a second of the launcher's wall time that no account saw.
                self.notes.mark_teardown()
                self.notes.remove()
                self.snapshot_dir.close()
                self.nodes.close()


def launch(config: config_lib.LaunchConfig) -> int:
    """Runs ``config``'s target as a group of processes, restarting the group on failure, until it ends.

    Returns:
      The exit code of the run: 0, ``jddp.EXIT_PREEMPTED``, the first failed process's code, or ``128 + signal``
      (see the module docstring).
    """
    return Launcher(config).run()


def main(argv: list[str] | None = None, *, prog: str = "jddp launch") -> int:
    """``jddp launch``: parses ``argv`` (default ``sys.argv[1:]``), launches, returns the exit code.

    Bad flags exit with code 2 and the message, before anything starts.
    """
    parser = config_lib.get_args_parser(prog)
    args = parser.parse_args(argv)
    try:
        config = config_lib.config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    return launch(config)
