"""``jddp launch``: start, watch and restart the processes of a data-parallel run (torchrun for JAX).

Usage::

    jddp launch [options] script.py [script args...]
    jddp launch [options] -m package.module [module args...]
    python -m jddp.launch [options] script.py [script args...]

Examples::

    # 2 processes with 4 simulated CPU devices each, on this machine
    jddp launch -n 2 --devices-per-process 4 train.py steps=1000

    # restart the whole group up to 3 times when a process fails
    jddp launch -n 2 --max-restarts 3 train.py

    # two hosts, 4 processes each; run one launcher per host
    jddp launch -n 4 --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:29500 train.py   # on 10.0.0.1
    jddp launch -n 4 --nnodes 2 --node-rank 1 --coordinator 10.0.0.1:29500 train.py   # on the other host

What each process gets: the environment variables ``JDDP_COORDINATOR``
(``host:port``), ``JDDP_NUM_PROCESSES`` (``nnodes * nprocs``),
``JDDP_PROCESS_ID`` (``node_rank * nprocs + local rank``), ``JDDP_LOCAL_RANK``,
``JDDP_LOCAL_DEVICES`` (with ``--devices-per-process``), ``JDDP_PEER_TIMEOUT``
(with ``--peer-timeout``), ``JDDP_RESTART_COUNT`` (0 on the first attempt) and
``JDDP_MAX_RESTARTS``. The script calls ``jddp.initialize()`` to join the group.
Without ``--coordinator`` the coordinator is ``127.0.0.1`` on a free port (a new
one for every attempt): a local run listens on loopback only. Unless
``GLIBC_TUNABLES`` is already set, workers get glibc allocator settings that
keep freed memory mapped (``--no-malloc-tuning`` turns this off); XLA:CPU
allocates fresh buffers for every collective, and this setting made gloo
all-reduces of 32 to 64 MiB 35 to 45% faster here.

Output: every line a process prints is prefixed with its process index,
``[1] ...``, on the launcher's stdout or stderr as the process wrote it. gloo's
``[Gloo] Rank N is connected to M peer ranks`` chatter is dropped.

Failures and restarts: the launcher polls its processes every
``--monitor-interval`` seconds. When one exits with a non-zero code, or is
killed, the group is broken: the launcher sends the others SIGTERM, then
SIGKILL after ``--kill-grace`` seconds, and starts the whole group again, up to
``--max-restarts`` times (a script resumes from its latest checkpoint, see
``jddp.Checkpointer``). When no restart is left, it prints a summary of how each
process ended, naming the first that failed, and exits with that process's code
(``128 + N`` for a process killed by signal ``N``). Exits with code 69
(``jddp.EXIT_PEER_LOST``) or by SIGABRT are consequences of another failure and
are never named as the cause when a better candidate exists.

Signals: SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every
process (each runs in its own session, so a terminal's Ctrl-C reaches them only
through the launcher). The processes get ``--term-timeout`` seconds to finish
(for example to save a preemption checkpoint), then SIGKILL; a second signal
kills at once. The group is not restarted after a signal. The launcher exits
with 75 (``jddp.EXIT_PREEMPTED``) when every process saved and stopped on
preemption, 0 when all finished normally, and ``128 + signal`` otherwise.
Exit code 75 from the processes without a signal to the launcher is passed on
the same way, without a restart, so that a scheduler can requeue the job.

The launcher imports no JAX: it only starts processes and reads their output.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from jddp import exitcodes, net

# gloo prints this from C++ threads without line buffering, so its pieces arrive whole, split, or inside a
# line the script printed at the same moment: the pieces are cut out wherever they are.
GLOO_CHATTER = re.compile(
    rb"\[Gloo\] Rank \d*|\d* ?is connected to \d+ peer ranks?\. Expected number of connected peer ranks is : \d+"
)
MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=17179869184"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def get_args_parser(prog: str = "jddp launch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start a data-parallel JAX run as several processes; restart it when one fails.",
        epilog="The manual is the docstring of jddp/launch.py (python -c 'import jddp.launch; help(jddp.launch)').",
    )
    parser.add_argument("-n", "--nprocs", type=int, default=1, help="processes on this node (default 1)")
    parser.add_argument(
        "--devices-per-process", type=int, default=None, metavar="D", help="simulated CPU devices in each process"
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordination service (default 127.0.0.1 and a free port; required with --nnodes)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of hosts, one launcher on each (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="index of this host, 0 to nnodes-1 (default 0)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts of the group after a failure (default 0)")
    parser.add_argument(
        "--monitor-interval", type=float, default=0.2, metavar="S", help="seconds between checks (default 0.2)"
    )
    parser.add_argument(
        "--kill-grace",
        type=float,
        default=3.0,
        metavar="S",
        help="after a failure, seconds between SIGTERM and SIGKILL for the others (default 3)",
    )
    parser.add_argument(
        "--term-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="after a forwarded signal, seconds the processes get before SIGKILL (default 30)",
    )
    parser.add_argument(
        "--peer-timeout", type=float, default=None, metavar="S", help="seconds before a silent peer counts as dead"
    )
    parser.add_argument("--no-malloc-tuning", action="store_true", help="do not set GLIBC_TUNABLES for the processes")
    parser.add_argument("-m", dest="module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("target", help="the script (or module with -m) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    def fail(message: str) -> None:
        parser.error(message)

    if args.nprocs < 1:
        fail(f"-n/--nprocs must be at least 1, got {args.nprocs}.")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        fail(f"--devices-per-process must be at least 1, got {args.devices_per_process}.")
    if args.nnodes < 1:
        fail(f"--nnodes must be at least 1, got {args.nnodes}.")
    if not 0 <= args.node_rank < args.nnodes:
        fail(f"--node-rank={args.node_rank} must be in [0, --nnodes={args.nnodes}).")
    if args.nnodes > 1 and args.coordinator is None:
        fail("--nnodes > 1 needs --coordinator HOST:PORT: an address of node 0 that every node can reach.")
    if args.coordinator is not None:
        try:
            net.split_address(args.coordinator, name="--coordinator")
        except ValueError as error:
            fail(str(error))
    if args.max_restarts < 0:
        fail(f"--max-restarts must be 0 or more, got {args.max_restarts}.")
    for name in ("monitor_interval", "kill_grace", "term_timeout"):
        if not getattr(args, name) > 0:
            fail(f"--{name.replace('_', '-')} must be a positive number of seconds, got {getattr(args, name)}.")
    if args.peer_timeout is not None and not args.peer_timeout > 0:
        fail(f"--peer-timeout must be a positive number of seconds, got {args.peer_timeout}.")
    if not args.module and not os.path.exists(args.target):
        fail(f"script {args.target!r} does not exist (use -m to run a module).")


@dataclass
class Worker:
    process_id: int
    popen: subprocess.Popen
    readers: list[threading.Thread] = field(default_factory=list)
    code: int | None = None


class _Output:
    """Copies a process's pipe to ours, line by line, with its index in front."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def pump(self, pipe, target, prefix: bytes) -> None:
        for line in iter(pipe.readline, b""):
            cleaned = GLOO_CHATTER.sub(b"", line)
            if cleaned != line:
                if not cleaned.strip():
                    continue
                line = cleaned
            if not line.endswith(b"\n"):
                line += b"\n"
            with self.lock:
                target.buffer.write(prefix + line) if hasattr(target, "buffer") else target.write(
                    (prefix + line).decode(errors="replace")
                )
                target.flush()
        pipe.close()


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.output = _Output()
        self.signal_received: int | None = None
        self.workers: list[Worker] = []

    # -- messages -----------------------------------------------------------
    def say(self, message: str) -> None:
        with self.output.lock:
            sys.stderr.write(f"jddp launch: {message}\n")
            sys.stderr.flush()

    # -- processes ----------------------------------------------------------
    def command(self) -> list[str]:
        a = self.args
        return [sys.executable, "-u", *(["-m"] if a.module else []), a.target, *a.args]

    def environment(self, local_rank: int, coordinator: str, attempt: int) -> dict[str, str]:
        a = self.args
        env = dict(os.environ)
        env.update(
            JDDP_COORDINATOR=coordinator,
            JDDP_NUM_PROCESSES=str(a.nnodes * a.nprocs),
            JDDP_PROCESS_ID=str(a.node_rank * a.nprocs + local_rank),
            JDDP_LOCAL_RANK=str(local_rank),
            JDDP_RESTART_COUNT=str(attempt),
            JDDP_MAX_RESTARTS=str(a.max_restarts),
            PYTHONUNBUFFERED="1",
        )
        if a.devices_per_process is not None:
            env["JDDP_LOCAL_DEVICES"] = str(a.devices_per_process)
        if a.peer_timeout is not None:
            env["JDDP_PEER_TIMEOUT"] = str(a.peer_timeout)
        if not a.no_malloc_tuning and "GLIBC_TUNABLES" not in env:
            env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
        return env

    def start(self, attempt: int) -> None:
        a = self.args
        coordinator = a.coordinator or f"127.0.0.1:{net.free_port()}"
        self.workers = []
        for local_rank in range(a.nprocs):
            env = self.environment(local_rank, coordinator, attempt)
            popen = subprocess.Popen(
                self.command(), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
            )
            worker = Worker(int(env["JDDP_PROCESS_ID"]), popen)
            prefix = f"[{worker.process_id}] ".encode()
            for pipe, target in ((popen.stdout, sys.stdout), (popen.stderr, sys.stderr)):
                reader = threading.Thread(target=self.output.pump, args=(pipe, target, prefix), daemon=True)
                reader.start()
                worker.readers.append(reader)
            self.workers.append(worker)
        first, last = self.workers[0].process_id, self.workers[-1].process_id
        self.say(
            f"started processes {first}..{last} of {a.nnodes * a.nprocs} (attempt {attempt + 1} of "
            f"{a.max_restarts + 1}, coordinator {coordinator}): {' '.join(self.command()[1:])}"
        )

    def poll(self) -> None:
        for w in self.workers:
            if w.code is None:
                w.code = w.popen.poll()

    def signal_all(self, signum: int) -> None:
        """Signals each process's whole session (its own children too, even after it exited)."""
        for w in self.workers:
            try:
                os.killpg(w.popen.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if all(w.code is not None for w in self.workers):
                return True
            time.sleep(0.05)
        return False

    def stop_all(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds, to every process still running."""
        self.signal_all(signal.SIGTERM)
        if not self.wait_all(grace):
            self.signal_all(signal.SIGKILL)
            self.wait_all(30)
        self.finish_output()

    def finish_output(self) -> None:
        self.signal_all(signal.SIGKILL)  # leftovers of exited processes would hold the pipes open
        for w in self.workers:
            for reader in w.readers:
                reader.join(timeout=5)

    # -- signals ------------------------------------------------------------
    def on_signal(self, signum: int, frame) -> None:
        # No printing here: the handler may interrupt `say`, which holds the output lock.
        if self.signal_received is not None:
            self.signal_all(signal.SIGKILL)
            return
        self.signal_received = signum
        self.signal_all(signum)

    # -- the run ------------------------------------------------------------
    def summary(self, first_failed: Worker | None) -> str:
        def describe(code: int | None) -> str:  # None: it outlived SIGKILL and the 30 s wait after it
            return "still running" if code is None else exitcodes.describe(code)

        lines = [f"process {w.process_id} (pid {w.popen.pid}): {describe(w.code)}" for w in self.workers]
        if first_failed is not None:
            lines.append(f"first failure: process {first_failed.process_id}, {describe(first_failed.code)}")
        return "\n  ".join(["summary:", *lines])

    def run_once(self, attempt: int) -> tuple[str, Worker | None]:
        """Runs one attempt; returns ("ok" | "failed" | "preempted" | "signal", the first failed process)."""
        self.start(attempt)
        first_failed: Worker | None = None
        while True:
            if self.signal_received is not None:
                self.say(f"got {signal.Signals(self.signal_received).name}; forwarded it to every process")
                self.signal_all(self.signal_received)  # processes started while the signal arrived get it too
                if not self.wait_all(self.args.term_timeout):
                    self.say(f"processes still running {self.args.term_timeout:g} s after the signal: SIGKILL")
                    self.signal_all(signal.SIGKILL)
                    self.wait_all(30)
                self.finish_output()
                return "signal", None
            self.poll()
            failed = [
                (w, w.code) for w in self.workers if w.code is not None and w.code not in (0, exitcodes.EXIT_PREEMPTED)
            ]
            if failed:
                # Of the processes found dead in the same round, a killed one is the likeliest cause,
                # and one that lost a peer the least likely.
                first_failed, code = min(failed, key=lambda wc: (exitcodes.is_peer_failure(wc[1]), wc[1] >= 0))
                what = exitcodes.describe(code)
                self.say(f"process {first_failed.process_id} {what}; stopping the others")
                self.stop_all(self.args.kill_grace)
                return "failed", first_failed
            if all(w.code is not None for w in self.workers):
                self.finish_output()
                if any(w.code == exitcodes.EXIT_PREEMPTED for w in self.workers):
                    return "preempted", None
                return "ok", None
            time.sleep(self.args.monitor_interval)

    def run(self) -> int:
        previous = {s: signal.signal(s, self.on_signal) for s in FORWARDED_SIGNALS}
        try:
            attempt = 0
            while True:
                outcome, first_failed = self.run_once(attempt)
                if outcome == "ok":
                    return 0
                if outcome == "preempted":
                    self.say(f"the run stopped on preemption (exit {exitcodes.EXIT_PREEMPTED}); run again to resume")
                    return exitcodes.EXIT_PREEMPTED
                if outcome == "signal":
                    codes = {w.code for w in self.workers}
                    if codes <= {0, exitcodes.EXIT_PREEMPTED}:
                        return exitcodes.EXIT_PREEMPTED if exitcodes.EXIT_PREEMPTED in codes else 0
                    self.say(self.summary(None))
                    assert self.signal_received is not None  # run_once returns "signal" only once one arrived
                    return 128 + self.signal_received
                if attempt < self.args.max_restarts and self.signal_received is None:
                    attempt += 1
                    restarts = f"{attempt} of {self.args.max_restarts}"
                    self.say(f"{self.summary(first_failed)}\nrestarting the group ({restarts})")
                    continue
                self.say(f"{self.summary(first_failed)}\nno restart left (--max-restarts {self.args.max_restarts})")
                # run_once returns "failed" with the worker that failed, whose exit code is set.
                assert first_failed is not None and first_failed.code is not None
                code = first_failed.code
                return 128 - code if code < 0 else code
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def main(argv: list[str] | None = None, prog: str = "jddp launch") -> int:
    parser = get_args_parser(prog)
    args = parser.parse_args(argv)
    _check(args, parser)
    return Launcher(args).run()


if __name__ == "__main__":
    sys.exit(main(prog="python -m jddp.launch"))
