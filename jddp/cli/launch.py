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
``JDDP_MAX_RESTARTS`` and ``JDDP_SNAPSHOT_DIR`` (below). The script calls ``jddp.initialize()`` to join the
group.
Without ``--coordinator`` the coordinator is ``127.0.0.1`` on a free port (a new
one for every attempt): a local run listens on loopback only.

The coordination service: node 0's launcher runs it in a process of its own
for every attempt (``python -m jddp.runtime.coordinator``, see there), not in
process 0, and the processes get ``JDDP_COORDINATOR_HOSTED=1``. Losing process 0
is then like losing any other: JAX would otherwise abort every survivor from
C++ the moment process 0 dies. After a failure of its own processes, node 0's
launcher keeps the service up ``peer timeout + 5`` seconds more, so that the
other nodes' processes find the failed one and name it. With ``--nnodes > 1``
node 0's launcher also listens on the coordinator's port + 1, where the other
launchers report a failed attempt (``jddp.cli.reports``): a process frozen on
node 0 would otherwise never learn that the group ended elsewhere. Unless
``GLIBC_TUNABLES`` is already set, workers get glibc allocator settings that
keep freed memory mapped (``--no-malloc-tuning`` turns this off); XLA:CPU
allocates fresh buffers for every collective, and this setting made gloo
all-reduces of 32 to 64 MiB 35 to 45% faster here.

Output: every line a process prints is prefixed with its process index,
``[1] ...``, on the launcher's stdout or stderr as the process wrote it. gloo's
``[Gloo] Rank N is connected to M peer ranks`` chatter is dropped.

Failures and restarts: the launcher polls its processes every
``--monitor-interval`` seconds. When one exits with a non-zero code, or is
killed, the group is broken. The others get ``peer timeout + 5`` seconds to end
by themselves, each naming what it lost (exit 69); 5 seconds when the first to
end lost a peer itself: a process still running then is the frozen one. Then
the launcher sends those left SIGTERM, SIGKILL after ``--kill-grace`` seconds,
and starts the whole group again, up to ``--max-restarts`` times (a script
resumes from its latest checkpoint, see ``jddp.Checkpointer``). When no restart
is left, it prints a summary of how each process ended (saying which ones it
had to stop), naming the first that failed, and exits with that process's code
(``128 + N`` for a process killed by signal ``N``). Exits with code 69
(``jddp.EXIT_PEER_LOST``) or by SIGABRT are consequences of another failure and
are never named as the cause when a better candidate exists. When they are the
only failures, the cause is a process that exited 0 while the others still
needed it (it returned early from the script, or called ``sys.exit(0)``): the
summary names it, a restart follows as after any failure, and the launcher exits
with the code of the first peer it left (69), never 0. The launcher exits 0 only
when every process exited 0 and none of them saw its peers stop waiting for it.

Notes from the processes: each process leaves a note in the launcher's temporary
``jddp-launch-*`` folder (``note-<process>.json``, ``jddp.runtime.watchdog``) when it
stops: the peers it found silent for the peer timeout, the cause it found (a
collective made by a subset of the processes), or, for a process that exited 0,
that its peers stopped waiting for it. The launcher SIGKILLs a process of its node
that a note (or another node's report) names silent at once, instead of waiting
for it (a stopped or GIL-holding process acts on no SIGTERM); the summary quotes
the causes; and a process that ended early fails the attempt on its own node too
(exit 69, reported to node 0), so that no launcher of a failed job exits 0.

Signals: SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every
process (each runs in its own session, so a terminal's Ctrl-C reaches them only
through the launcher). The processes get ``--term-timeout`` seconds to finish
(for example to save a preemption checkpoint), then SIGKILL; a second signal
kills at once. The group is not restarted after a signal. The launcher exits
with 75 (``jddp.EXIT_PREEMPTED``) when every process saved and stopped on
preemption, 0 when all finished normally, and ``128 + signal`` otherwise.
Exit code 75 from the processes without a signal to the launcher is passed on
the same way, without a restart, so that a scheduler can requeue the job.

A restart's critical path: the launcher wakes as soon as a process ends (a ``pidfd`` per process, else the
``--monitor-interval`` poll), SIGKILLs the others, and starts the next attempt without waiting for the old
group's last output (it is still copied, while the next attempt runs; all of it before the launcher exits) or
for the old coordination service to stop (a local run's next service listens on a new port: started, with the
spares, while the attempt before it runs). With ``--max-restarts`` > 0 and an attempt's processes past their
first step (their goodput ledger says so; else ``PREPARE_AFTER_S`` seconds after the attempt started), the
launcher starts one spare per local process (``python -u -m jddp.cli.spare``, see there): a process that has
imported JAX, Flax, Optax, Orbax, Grain and jddp and waits. A restart hands each spare its process's role (the
environment described above, the command) instead of starting a new process, says ``process(es) ... handed to
their spares``, and starts a process anew where a spare has ended; a spare's lines get the ``[N] `` of the role
it took; spares not needed are ended with the launcher. ``--no-spares`` turns them off; ``--transport mpi`` has
none. With ``--cpu-share`` a spare is pinned to the cores of its local rank from its start, as a process is.

Standby (one node, the launcher's own coordinator: no ``--coordinator``, ``--nnodes 1``): once the spares are
ready and the next service listens, each spare is handed its role in the next attempt at once and runs the script
up to its restore (``jddp.runtime.standby``): it joins the next attempt's group, builds the model and the data,
compiles the step, and waits. Its output is held meanwhile. A restart then wakes them (``process(es) ... woken
from standby``) and releases their output: what is left is the failed group's end and the restore. When not
every standby process stands by at the failure (one ended, or the script stands by nowhere), they and the next
service are ended and the attempt starts as without them. ``--no-standby`` keeps the spares at their imports.

The snapshot directory: each launcher makes one directory in memory for the run (under ``/dev/shm`` when it is
a tmpfs, else the temporary directory: ``jddp-snapshots-<launcher pid>-<random>``), passes it to every process
as ``JDDP_SNAPSHOT_DIR``, keeps it across attempts and removes it when it ends; one the user set in
``JDDP_SNAPSHOT_DIR`` is passed instead and never removed. A launcher that was SIGKILLed leaves its directory:
each launcher removes, when it starts, the ``jddp-snapshots-<pid>-*`` directories whose launcher no longer runs:
whose lock file no process holds (a launcher holds a ``flock`` on its directory's ``SNAPSHOT_LOCK`` while it runs,
and the kernel drops it when the launcher dies, SIGKILL included; this holds across PID namespaces that share
``/dev/shm``, where a pid names nobody or somebody else).

From Python: ``launch(config_from_args(get_args_parser().parse_args(argv)))``, or
``launch(LaunchConfig(target="train.py", nprocs=2))``; ``launch`` returns the exit
code described above.

The launcher imports no JAX: it only starts processes and reads their output.
This module is the launcher's manual as well as its code, which takes it past
the ~400 lines of the style guide; the output handling is in ``jddp.cli.output``,
the spares' side in ``jddp.cli.spare``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from types import FrameType

from jddp import envvars, exitcodes, net
from jddp.cli import output, reports
from jddp.cli import spare as spare_lib

STARTED = time.time()  # the run's start for the goodput ledger (jddp.goodput): the launcher's own included
DEFAULT_PEER_TIMEOUT_S: float = envvars.VARIABLES["JDDP_PEER_TIMEOUT"].default  # distributed's (no JAX here)
ENV_STDOUT_FD = "JDDP_STDOUT_FD"  # the pipe for Python's stdout (jddp.runtime.distributed.ENV_STDOUT_FD)
ENV_COORDINATOR_HOSTED = "JDDP_COORDINATOR_HOSTED"  # jddp.runtime.distributed.ENV_COORDINATOR_HOSTED
# The launcher's coordination service: its heartbeat timeout is a backstop only (the processes' watchdogs and
# this launcher end a broken group long before), its shutdown timeout that of jddp.initialize's default.
SERVICE_HEARTBEAT_S = 3600
SERVICE_SHUTDOWN_S = 300
SERVICE_START_TIMEOUT_S = 60.0
PEER_LOST_WAIT_S = 5.0  # after a process exits 69, how long the others get to end by themselves
# Nodes other than 0: how long node 0's coordination service may go unanswered (after it first answered) before
# this node's processes, still running, are stopped: the group has ended there (a frozen process here never would).
SERVICE_GONE_S = 5.0
SERVICE_READY = b"jddp coordinator: listening on"  # jddp.runtime.coordinator.READY
SERVICE_STOP_SIGNAL = signal.SIGUSR1  # jddp.runtime.coordinator.STOP_SIGNAL
SERVICE_GRACE_S = 10.0  # the service outlives a launcher killed without a word by this long, then ends
NOTE_GLOB = re.compile(r"note-(\d+)\.json")  # jddp.runtime.watchdog.NOTE_FILE: what a process tells its launcher
MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=17179869184"
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STANDBY_READY = "standby process(es) of the next attempt ready: compiled, waiting before their restore"
# With a restart left: how long after an attempt's start the spares and the next coordination service start when
# the processes' goodput ledger does not say earlier that they are past their first step (a script without fit).
PREPARE_AFTER_S = 3.0
ENV_SNAPSHOT_DIR = "JDDP_SNAPSHOT_DIR"  # the run's snapshot directory (jddp.envvars)
SNAPSHOT_PREFIX = "jddp-snapshots-"  # the launcher's snapshot directory: jddp-snapshots-<launcher pid>-<random>
SNAPSHOT_LOCK = ".launcher.lock"  # in it: flocked by its launcher while it runs (sweep_snapshots)


def get_args_parser(prog: str = "jddp launch") -> argparse.ArgumentParser:
    """The launcher's flags, then the script (or module with ``-m``) and the arguments passed through to it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start a data-parallel JAX run as several processes; restart it when one fails.",
        epilog="The manual is the docstring of jddp/cli/launch.py "
        "(python -c 'import jddp.cli.launch; help(jddp.cli.launch)').",
    )
    parser.add_argument("-n", "--nprocs", type=envvars.count(1), default=1, help="processes on this node (default 1)")
    parser.add_argument(
        "--devices-per-process",
        type=envvars.count(1),
        default=None,
        metavar="D",
        help="simulated CPU devices in each process (default: none simulated; $JDDP_LOCAL_DEVICES if set, else "
        "the devices JAX finds)",
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordination service (default 127.0.0.1 and a free port; required with --nnodes)",
    )
    parser.add_argument(
        "--nnodes", type=envvars.count(1), default=1, help="number of hosts, one launcher on each (default 1)"
    )
    parser.add_argument(
        "--node-rank", type=envvars.count(0), default=0, help="index of this host, 0 to nnodes-1 (default 0)"
    )
    parser.add_argument(
        "--max-restarts", type=envvars.count(0), default=0, help="restarts of the group after a failure (default 0)"
    )
    parser.add_argument(
        "--monitor-interval",
        type=envvars.seconds(),
        default=0.2,
        metavar="S",
        help="seconds between checks (default 0.2)",
    )
    parser.add_argument(
        "--kill-grace",
        type=envvars.seconds(),
        default=3.0,
        metavar="S",
        help="after a failure, seconds between SIGTERM and SIGKILL for the others (default 3)",
    )
    parser.add_argument(
        "--term-timeout",
        type=envvars.seconds(),
        default=30.0,
        metavar="S",
        help="after a forwarded signal, seconds the processes get before SIGKILL (default 30)",
    )
    parser.add_argument(
        "--peer-timeout",
        type=envvars.seconds(),
        default=None,
        metavar="S",
        help="seconds before a silent peer counts as dead, the peer timeout T "
        f"(default: $JDDP_PEER_TIMEOUT if set, else {DEFAULT_PEER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--no-malloc-tuning",
        action="store_true",
        help="do not set GLIBC_TUNABLES for the processes (default: set it, unless already set)",
    )
    parser.add_argument(
        "--cpu-share",
        action="store_true",
        help="pin each process to its own share of the cores, with OpenMP and XLA threads to match; measured "
        "slower on a 2-core VM, see BENCHMARKS.md (default: off)",
    )
    parser.add_argument(
        "--no-spares",
        action="store_true",
        help="with --max-restarts, start no spare processes that import JAX before a restart needs them "
        "(default: one spare per process, see jddp.cli.spare)",
    )
    parser.add_argument(
        "--no-standby",
        action="store_true",
        help="with spares, do not run the next attempt's script up to its restore in them before a failure (default: "
        "on one node, standby: see jddp.runtime.standby)",
    )
    parser.add_argument(
        "--transport",
        choices=("xla", "mpi"),
        default="xla",
        help="how the processes sum gradients: xla (gloo on CPU) or mpi (MPI_Allreduce, the jddp[mpi] extra: "
        "the processes are started under the mpich wheel's mpiexec) (default: %(default)s)",
    )
    parser.add_argument(
        "-m", dest="module", action="store_true", help="run the target as a module, python -m (default: a script)"
    )
    parser.add_argument("target", help="the script (or module with -m) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


@dataclasses.dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What to run and how; checked when built. Each field is the flag of the same name (``--no-malloc-tuning``
    is ``malloc_tuning=False``).

    Raises:
      ValueError: naming the flag, the value that arrived and what it must be.

    Example:
      >>> LaunchConfig(target="train", module=True, nprocs=0)
      Traceback (most recent call last):
      ValueError: -n/--nprocs must be at least 1, got 0.
    """

    target: str  # the script, or the module with `module=True`
    target_args: tuple[str, ...] = ()  # passed through to the target
    module: bool = False  # run the target as `python -m target`
    nprocs: int = 1  # processes on this node
    devices_per_process: int | None = None  # simulated CPU devices in each process
    coordinator: str | None = None  # "host:port" of process 0's coordination service; None: loopback, a free port
    nnodes: int = 1  # hosts, one launcher on each
    node_rank: int = 0  # index of this host
    max_restarts: int = 0  # restarts of the group after a failure
    monitor_interval: float = 0.2  # seconds between checks
    kill_grace: float = 3.0  # after a failure, seconds between SIGTERM and SIGKILL for the others
    term_timeout: float = 30.0  # after a forwarded signal, seconds the processes get before SIGKILL
    peer_timeout: float | None = None  # seconds before a silent peer counts as dead (JDDP_PEER_TIMEOUT)
    malloc_tuning: bool = True  # set GLIBC_TUNABLES for the processes unless already set
    cpu_share: bool = False  # each process its share of this node's cores (affinity, XLA and OpenMP threads)
    spares: bool = True  # with max_restarts > 0, spare processes with the imports done wait for a restart
    standby: bool = True  # spares run the next attempt's script up to its restore (one node, own coordinator)
    transport: str = "xla"  # "mpi": the processes run under mpiexec and sum through MPI (jddp.engine.mpi)

    def __post_init__(self) -> None:
        if self.nprocs < 1:
            raise ValueError(f"-n/--nprocs must be at least 1, got {self.nprocs}.")
        if self.devices_per_process is not None and self.devices_per_process < 1:
            raise ValueError(f"--devices-per-process must be at least 1, got {self.devices_per_process}.")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in [0, --nnodes={self.nnodes}).")
        if self.nnodes > 1 and self.coordinator is None:
            raise ValueError(
                "--nnodes > 1 needs --coordinator HOST:PORT: an address of node 0 that every node can reach."
            )
        if self.coordinator is not None:
            _, port = net.split_address(self.coordinator, name="--coordinator")
            if self.nnodes > 1 and port + reports.PORT_OFFSET > 65535:
                raise ValueError(
                    f"--coordinator {self.coordinator}: with --nnodes > 1 node 0's launcher also listens on the "
                    f"coordinator's port + 1 (the other launchers report there), so the port must be below 65535."
                )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}.")
        for name in ("monitor_interval", "kill_grace", "term_timeout", "peer_timeout"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be a positive, finite number of seconds, got {value}.")
        if self.transport not in ("xla", "mpi"):
            raise ValueError(f"--transport must be xla or mpi, got {self.transport!r}.")
        if self.transport == "mpi" and (self.nnodes > 1 or (self.devices_per_process or 1) > 1 or self.cpu_share):
            raise ValueError(
                "--transport mpi runs one device per process on this node under MPI's own launcher: drop --nnodes, "
                "--devices-per-process and --cpu-share (for several hosts, start the processes with mpiexec's "
                "-hosts or with srun; jddp.initialize() joins the MPI world)."
            )
        if not self.module and not os.path.exists(self.target):
            raise ValueError(f"script {self.target!r} does not exist (use -m to run a module).")


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """The ``LaunchConfig`` of parsed flags.

    Raises:
      ValueError: as ``LaunchConfig`` does, when a flag's value is out of range.

    Example:
      >>> config = config_from_args(get_args_parser().parse_args(["-n", "2", "-m", "train", "steps=10"]))
      >>> config.nprocs, config.module, config.target, config.target_args
      (2, True, 'train', ('steps=10',))
    """
    options = dict(vars(args))  # the flags' names are the fields' names, but for these four
    target_args, no_malloc_tuning = options.pop("args"), options.pop("no_malloc_tuning")
    no_spares, no_standby = options.pop("no_spares"), options.pop("no_standby")
    return LaunchConfig(
        target_args=tuple(target_args),
        malloc_tuning=not no_malloc_tuning,
        spares=not no_spares,
        standby=not no_standby,
        **options,
    )


def command(config: LaunchConfig) -> list[str]:
    """The command line of every process: ``python -u [-m] target *target_args``."""
    return [sys.executable, "-u", *(["-m"] if config.module else []), config.target, *config.target_args]


def cpu_shares(cores: list[int], nprocs: int) -> list[list[int]]:
    """Each of ``nprocs`` processes' cores: contiguous blocks, as even as they go; with fewer cores than
    processes, each process one core, the cores taken in turn.

    >>> cpu_shares([0, 1, 2, 3, 4], 2), cpu_shares([0, 1], 3)
    ([[0, 1, 2], [3, 4]], [[0], [1], [0]])
    """
    cores = sorted(cores)
    if len(cores) < nprocs:
        return [[cores[i % len(cores)]] for i in range(nprocs)]
    size, extra = divmod(len(cores), nprocs)
    shares, start = [], 0
    for i in range(nprocs):
        end = start + size + (1 if i < extra else 0)
        shares.append(cores[start:end])
        start = end
    return shares


def share_environment(env: dict[str, str], cores: list[int]) -> None:
    """The threads of a process pinned to ``cores``: OpenMP's and XLA's (one core: no Eigen thread pool, whose
    threads would only contend with the process's own), unless the user set them."""
    env.setdefault("OMP_NUM_THREADS", str(len(cores)))
    if len(cores) == 1 and "xla_cpu_multi_thread_eigen" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()


def base_environment(config: LaunchConfig) -> dict[str, str]:
    """Our environment plus what every process gets whatever its role: what a spare starts with."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if config.malloc_tuning and "GLIBC_TUNABLES" not in env:
        env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    return env


def environment(config: LaunchConfig, local_rank: int, coordinator: str, attempt: int) -> dict[str, str]:
    """Our environment plus the ``JDDP_*`` variables of process ``local_rank`` on this node (see the manual)."""
    env = base_environment(config)
    env.update(
        JDDP_COORDINATOR=coordinator,
        JDDP_NUM_PROCESSES=str(config.nnodes * config.nprocs),
        JDDP_PROCESS_ID=str(config.node_rank * config.nprocs + local_rank),
        JDDP_LOCAL_RANK=str(local_rank),
        JDDP_RESTART_COUNT=str(attempt),
        JDDP_MAX_RESTARTS=str(config.max_restarts),
    )
    if config.devices_per_process is not None:
        env["JDDP_LOCAL_DEVICES"] = str(config.devices_per_process)
    if config.peer_timeout is not None:
        env["JDDP_PEER_TIMEOUT"] = str(config.peer_timeout)
    return env


def snapshot_base() -> str:
    """Where the launcher makes its snapshot directory: ``/dev/shm`` when it is a tmpfs (memory), else the temporary
    directory."""
    with contextlib.suppress(OSError):
        with open("/proc/self/mounts") as f:
            if any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in f):
                return "/dev/shm"
    return tempfile.gettempdir()


def make_locked_dir(base: str) -> tuple[str, int]:
    """A new snapshot directory in ``base``, ``jddp-snapshots-<pid>-<random>``, and the descriptor of its
    ``SNAPSHOT_LOCK`` file, on which this process holds an exclusive ``flock`` until it ends (the kernel drops it
    when the process dies, SIGKILL included). The directory is made and locked under a name ``sweep_snapshots``
    ignores, then renamed: it is never seen unlocked."""
    hidden = tempfile.mkdtemp(prefix=f".{SNAPSHOT_PREFIX}{os.getpid()}-", dir=base)
    fd = os.open(os.path.join(hidden, SNAPSHOT_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    path = os.path.join(base, os.path.basename(hidden)[1:])
    os.rename(hidden, path)
    return path, fd


def sweep_snapshots(base: str) -> list[str]:
    """Removes the snapshot directories in ``base`` of launchers that no longer run (one SIGKILLed cannot remove its
    own); returns them. A directory's launcher runs while it holds the ``flock`` of its ``SNAPSHOT_LOCK`` file: that
    holds across PID namespaces (containers sharing ``/dev/shm``), where a pid says nothing. Those of running
    launchers, and of other users' (not ours to lock), stay. A directory without the lock file (a launcher of an
    older jddp) is judged by its pid, as before."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            pid = name[len(SNAPSHOT_PREFIX) :].split("-", 1)[0]
            if not name.startswith(SNAPSHOT_PREFIX) or not pid.isdigit():
                continue
            path = os.path.join(base, name)
            try:
                fd = os.open(os.path.join(path, SNAPSHOT_LOCK), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None
            except OSError:
                continue  # another user's, or going away
            try:
                if fd is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        continue  # its launcher runs
                elif int(pid) == os.getpid() or _pid_runs(int(pid)):
                    continue
                shutil.rmtree(path, ignore_errors=True)
            finally:
                if fd is not None:
                    os.close(fd)
            if not os.path.exists(path):
                removed.append(path)
    return removed


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process runs under that pid
    return True


def pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` ends (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


@dataclasses.dataclass
class _Worker:
    process_id: int
    popen: subprocess.Popen[bytes]
    readers: list[threading.Thread] = dataclasses.field(default_factory=list)
    code: int | None = None
    ended: float | None = None  # monotonic time its exit was seen
    ended_at: float | None = None  # the same as wall time, for the summary
    unresponsive: bool = False  # still running when the group had failed: the launcher killed it
    stopped_for_restart: bool = False  # still running when another failed and a restart followed: killed at once
    from_spare: str = ""  # "handed": a spare took this role (jddp.cli.spare); "woken": it stood by in it
    pidfd: int | None = None  # readable once it ended: the launcher wakes at once (pidfd)


class _Launcher:
    """One launcher's group of processes across its attempts."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.output = output.Output()
        self.signal_received: int | None = None
        self.workers: list[_Worker] = []
        self.service: subprocess.Popen[bytes] | None = None
        self.probed_at, self.service_answered, self.service_silent_since = 0.0, False, None
        self.attempt_start = self.run_start = STARTED
        self.previous_end: float | None = None
        self.attempt = 0
        self.note_dir = tempfile.mkdtemp(prefix="jddp-launch-")  # JDDP_LEDGER_NOTE: where fit's ledger is
        self.reports: reports.ReportServer | None = None  # node 0 of several: the other launchers' reports
        self.spares: dict[int, spare_lib.Spare] = {}  # by local rank: waiting for a restart's role
        self.spares_said_ready = False
        self.standby_handed = False  # this attempt's spares were handed their roles in the next attempt
        self.standby_said = False
        self.prepared = False  # this attempt's spares and next service started
        self.next_service: tuple[str, subprocess.Popen[bytes], threading.Event, list[bytes]] | None = None
        self.draining: list[threading.Thread] = []  # output readers of a stopped group, joined at the end
        self.reapers: list[threading.Thread] = []  # services stopping in the background, joined at the end
        self.snapshot_dir: str | None = None  # JDDP_SNAPSHOT_DIR, made by run() unless the user set one
        self.own_snapshot_dir = False
        self.snapshot_lock: int | None = None  # the flock held on the directory's lock file (make_locked_dir)

    # -- the coordination service (node 0 only) -------------------------------
    def start_service(self, coordinator: str) -> None:
        """Starts the group's coordination service in a process of its own (``await_service`` waits until it
        listens: the workers start meanwhile, their imports overlapping the service's).

        Raises:
          OSError: the coordinator address is taken.
        """
        net.check_port_free(*net.split_address(coordinator))
        self.service, self.service_ready, self.service_said = self.spawn_service(coordinator)

    def spawn_service(self, coordinator: str) -> tuple[subprocess.Popen[bytes], threading.Event, list[bytes]]:
        """The service's process, the event set once it listens, and what it said until then."""
        argv = [str(self.config.nnodes * self.config.nprocs), str(SERVICE_HEARTBEAT_S), str(SERVICE_SHUTDOWN_S)]
        # As for process 0's own service: the job's SIGTERM, SIGINT and SIGHUP (scancel, a time limit, a cgroup
        # kill signal every process) are for the workers, which need the service to agree on a step and save; it
        # stops on SERVICE_STOP_SIGNAL from this launcher, or SERVICE_GRACE_S after this launcher is gone.
        argv += ["--parent", str(os.getpid()), "--grace", str(SERVICE_GRACE_S)]
        service = subprocess.Popen(
            [sys.executable, "-u", "-m", "jddp.runtime.coordinator", coordinator, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C in the terminal reaches the launcher only
        )
        assert service.stdout is not None
        said: list[bytes] = []
        ready = threading.Event()

        def read(pipe) -> None:
            for line in pipe:
                if not ready.is_set():
                    said.append(line)
                    if line.startswith(SERVICE_READY):
                        ready.set()

        threading.Thread(target=read, args=(service.stdout,), daemon=True).start()
        return service, ready, said

    def await_service(self, coordinator: str) -> None:
        """Waits until the service started by ``start_service`` listens.

        Raises:
          OSError: the service did not start (with its output).
        """
        assert self.service is not None
        deadline = time.monotonic() + SERVICE_START_TIMEOUT_S
        while not self.service_ready.wait(0.05):
            if self.service.poll() is not None or time.monotonic() > deadline:
                self.stop_service()
                text = b"".join(self.service_said).decode(errors="replace").strip() or "no output"
                raise OSError(f"the coordination service at {coordinator} did not start:\n{text}")

    def stop_service(self, *, wait: bool = True) -> None:
        """Stops the attempt's service; without ``wait`` in the background (joined when the launcher ends): the next
        attempt's service listens on another port, and nothing needs this one any more."""
        service, self.service = self.service, None
        if service is None:
            return

        def stop() -> None:
            if service.poll() is None:
                service.send_signal(SERVICE_STOP_SIGNAL)
                try:
                    service.wait(10)
                except subprocess.TimeoutExpired:
                    service.kill()
                    service.wait()

        if wait:
            stop()
            return
        reaper = threading.Thread(target=stop, daemon=True)
        reaper.start()
        self.reapers.append(reaper)

    def adopt_next_service(self) -> str | None:
        """The next attempt's coordinator, when its service was started in advance (``prepare_restart``) and still
        runs: it becomes this attempt's service."""
        next_service, self.next_service = self.next_service, None
        if next_service is None:
            return None
        coordinator, popen, ready, said = next_service
        if popen.poll() is not None:
            return None
        self.service, self.service_ready, self.service_said = popen, ready, said
        return coordinator

    # -- getting ready for a restart: spares and the next service --------------------
    def prepare_restart(self) -> None:
        """Once this attempt's processes are past their first step (or ``PREPARE_AFTER_S`` after its start), with a
        restart left: starts the next attempt's coordination service (a local run's: a fresh free port) and one spare
        per local process (``jddp.cli.spare``), so that a restart waits for neither."""
        c = self.config
        if self.prepared or self.attempt >= c.max_restarts or c.transport != "xla":
            return
        if time.time() - self.attempt_start < PREPARE_AFTER_S and not self.first_step_taken():
            return
        self.prepared = True
        if c.node_rank == 0 and c.coordinator is None and self.next_service is None:
            coordinator = f"127.0.0.1:{net.free_port()}"
            self.next_service = (coordinator, *self.spawn_service(coordinator))
        if c.spares:
            for local_rank in range(c.nprocs):
                if local_rank not in self.spares:
                    self.spares[local_rank] = self.start_spare(local_rank)

    def first_step_taken(self) -> bool:
        """Whether this attempt's goodput ledger (fit's, named in the note ``JDDP_LEDGER_NOTE``) has a first step."""
        from jddp import goodput  # no JAX, no NumPy

        try:
            with open(os.path.join(self.note_dir, "ledger")) as f:
                path = f.read().strip()
            with open(path, "rb") as f:
                start, first_step_end = (
                    struct.unpack("<d", os.pread(f.fileno(), 8, 8 * goodput.SLOTS.index(name)))[0]
                    for name in ("attempt_start", "first_step_end")
                )
        except (OSError, ValueError, struct.error):
            return False
        return abs(start - self.attempt_start) < 1e-3 and first_step_end > 0

    def start_spare(self, local_rank: int) -> spare_lib.Spare:
        env = base_environment(self.config)
        if self.snapshot_dir is not None:
            env[ENV_SNAPSHOT_DIR] = self.snapshot_dir
        cores = self.cores(local_rank, env)
        ours, theirs = socket.socketpair()
        prefix = output.Prefix(f"[spare {local_rank}] ".encode())  # a spare prints nothing before its role
        argv = [sys.executable, "-u", "-m", "jddp.cli.spare", str(theirs.fileno())]
        try:
            popen, readers, stdout_fd = self.spawn(argv, env, cores, prefix, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        return spare_lib.Spare(local_rank, popen, ours, prefix, readers, stdout_fd)

    def spares_ready(self) -> None:
        """Says once when every spare finished its imports, then hands them their standby roles."""
        if self.spares and not self.spares_said_ready and all(s.ready() for s in self.spares.values()):
            self.spares_said_ready = True
            self.output.say(f"{len(self.spares)} spare process(es) ready for a restart")
        if self.spares_said_ready:
            self.hand_standby()
        if self.standby_handed and not self.standby_said:
            if self.standing_by():
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

    def hand_standby(self) -> None:
        """Once every spare is ready and the next service listens: each spare becomes its process of the next
        attempt, in standby (``jddp.runtime.standby``)."""
        if self.standby_handed or not self.standby_possible() or self.next_service is None:
            return
        coordinator, _, ready, _ = self.next_service
        if not ready.is_set() or len(self.spares) != self.config.nprocs:
            return
        self.standby_handed = True
        c = self.config
        for local_rank, spare in self.spares.items():
            env = self.role_environment(local_rank, coordinator, self.attempt + 1)
            env[ENV_STDOUT_FD] = str(spare.stdout_fd)
            message = spare_lib.role(env, module=c.module, target=c.target, args=c.target_args, standby=True)
            spare.hand(message, int(env["JDDP_PROCESS_ID"]), standby=True)  # one that ended is found at the restart

    def standing_by(self) -> bool:
        """Whether every local process of the next attempt stands by, and their service still runs."""
        spares = self.spares.values()
        return (
            self.next_service is not None
            and self.next_service[1].poll() is None
            and len(self.spares) == self.config.nprocs
            and all(s.standby for s in spares)
            and all([s.standing_by() for s in spares])  # a list: each reads its message
        )

    def discard_spares(self) -> None:
        spares, self.spares = self.spares, {}
        for spare in spares.values():
            spare.discard()
            self.draining += spare.readers

    # -- processes ----------------------------------------------------------
    def start(self, attempt: int) -> None:
        c = self.config
        # the goodput ledger's start of this attempt (JDDP_ATTEMPT_START); the first one starts with the launcher
        self.attempt_start = STARTED if attempt == 0 else time.time()
        self.clear_notes()
        self.prepared = self.spares_said_ready = False
        for w in self.workers:  # the previous attempt's
            if w.pidfd is not None:
                os.close(w.pidfd)
        if self.standby_handed and not self.standing_by():
            standing = sum(s.standing_by() for s in self.spares.values())
            self.output.say(
                f"{standing} of {c.nprocs} standby process(es) stood by at the failure: ending them, starting the "
                "processes anew"
            )
            self.discard_spares()
            if self.adopt_next_service() is not None:  # the ended standby processes had joined it
                self.stop_service(wait=False)
        self.standby_handed = self.standby_said = False
        coordinator = self.adopt_next_service() if c.node_rank == 0 else None
        if coordinator is None:
            coordinator = c.coordinator or f"127.0.0.1:{net.free_port()}"
            if c.node_rank == 0:
                self.start_service(coordinator)
        self.workers = [self.start_one(local_rank, coordinator, attempt) for local_rank in range(c.nprocs)]
        if c.node_rank == 0:
            try:
                self.await_service(coordinator)
            except OSError:
                self.signal_all(signal.SIGKILL)  # they would wait for a service that is not coming
                self.wait_all(30)
                self.finish_output()
                raise
        first, last = self.workers[0].process_id, self.workers[-1].process_id
        self.output.say(
            f"started processes {first}..{last} of {c.nnodes * c.nprocs} (attempt {attempt + 1} of "
            f"{c.max_restarts + 1}, coordinator {coordinator}): {' '.join(command(c)[1:])}"
        )
        for kind, how in (("handed", "handed to their spares, not started anew"), ("woken", "woken from standby")):
            handed = [w for w in self.workers if w.from_spare == kind]
            if handed:
                said = ", ".join(f"{w.process_id} (pid {w.popen.pid})" for w in handed)
                self.output.say(f"process(es) {said} {how}")

    def role_environment(self, local_rank: int, coordinator: str, attempt: int) -> dict[str, str]:
        """The environment of process ``local_rank`` of attempt ``attempt``, but for the moment it starts at
        (``moment_environment``), with its cores' thread settings under ``--cpu-share``."""
        env = environment(self.config, local_rank, coordinator, attempt)
        env[ENV_COORDINATOR_HOSTED] = "1"  # node 0's launcher runs it (start_service)
        env["JDDP_RUN_START"] = f"{self.run_start:.6f}"
        env["JDDP_LEDGER_NOTE"] = os.path.join(self.note_dir, "ledger")
        if self.snapshot_dir is not None:
            env[ENV_SNAPSHOT_DIR] = self.snapshot_dir
        self.cores(local_rank, env)
        return env

    def moment_environment(self) -> dict[str, str]:
        """For the goodput ledger (``jddp.goodput``): when this attempt began, and when the group of the previous
        attempt had ended (the time between is downtime)."""
        env = {"JDDP_ATTEMPT_START": f"{self.attempt_start:.6f}"}
        if self.previous_end is not None:
            env["JDDP_PREVIOUS_END"] = f"{self.previous_end:.6f}"
        return env

    def start_one(self, local_rank: int, coordinator: str, attempt: int) -> _Worker:
        moment = self.moment_environment()
        spare = self.spares.pop(local_rank, None)
        if spare is not None and spare.standby:  # standing by as this very process (start checked)
            process_id = self.config.node_rank * self.config.nprocs + local_rank
            spare.wake(spare_lib.wake(moment), self.output)  # one that ended as it was woken: this attempt fails
            return _Worker(process_id, spare.popen, spare.readers, from_spare="woken", pidfd=pidfd(spare.popen.pid))
        env = self.role_environment(local_rank, coordinator, attempt) | moment
        cores = self.cores(local_rank, env)
        process_id = int(env["JDDP_PROCESS_ID"])
        if spare is not None:  # the same environment, with the spare's own pipe for Python's stdout
            c = self.config
            message = spare_lib.role({**env, ENV_STDOUT_FD: str(spare.stdout_fd)}, module=c.module, target=c.target,
                                     args=c.target_args)  # fmt: skip
            if spare.hand(message, process_id):
                handle = pidfd(spare.popen.pid)
                return _Worker(process_id, spare.popen, spare.readers, from_spare="handed", pidfd=handle)
            self.draining += spare.readers
            self.output.say(f"the spare for process {process_id} had ended: starting the process anew")
        popen, readers, _ = self.spawn(command(self.config), env, cores, output.Prefix(f"[{process_id}] ".encode()))
        return _Worker(process_id, popen, readers, pidfd=pidfd(popen.pid))

    def cores(self, local_rank: int, env: dict[str, str]) -> list[int] | None:
        """With ``--cpu-share``: the cores of process ``local_rank`` of this node, its threads set in ``env``."""
        if not (self.config.cpu_share and self.config.nprocs > 1 and hasattr(os, "sched_setaffinity")):
            return None
        cores = cpu_shares(sorted(os.sched_getaffinity(0)), self.config.nprocs)[local_rank]
        share_environment(env, cores)
        return cores

    def spawn(
        self, argv: list[str], env: dict[str, str], cores: list[int] | None, prefix: output.Prefix, pass_fds=()
    ) -> tuple[subprocess.Popen[bytes], list[threading.Thread], int]:
        """Starts a process (a worker or a spare) in a session of its own, its output copied to ours after
        ``prefix``; returns it, the readers of its output and the number of its pipe for Python's stdout."""
        # Python's stdout gets a pipe of its own (jddp.initialize() moves sys.stdout there), apart from fd 1,
        # where C++ (gloo) writes: see jddp.cli.output.
        python_read, python_write = os.pipe()
        env[ENV_STDOUT_FD] = str(python_write)
        try:
            popen = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=(python_write, *pass_fds),
            )
        finally:
            os.close(python_write)
        if cores is not None:  # before its interpreter starts threads: they inherit the mask
            with contextlib.suppress(OSError):
                os.sched_setaffinity(popen.pid, cores)
        pipes = (
            (popen.stdout, sys.stdout, True),
            (os.fdopen(python_read, "rb", buffering=0), sys.stdout, False),
            (popen.stderr, sys.stderr, False),
        )
        readers = []
        for pipe, target, native in pipes:
            reader = threading.Thread(
                target=self.output.pump, args=(pipe, target, prefix), kwargs={"native": native}, daemon=True
            )
            reader.start()
            readers.append(reader)
        return popen, readers, python_write

    def poll(self) -> None:
        for w in self.workers:
            if w.code is None:
                w.code = w.popen.poll()
                if w.code is not None:
                    w.ended, w.ended_at = time.monotonic(), time.time()

    def signal_all(self, signum: int) -> None:
        """Signals each process's whole session (its own children too, even after it exited)."""
        for w in self.workers:
            try:
                os.killpg(w.popen.pid, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def wait_silent(self, timeout: float) -> bool:
        """``wait_all``, stopping at once the processes that a survivor names silent meanwhile."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.silent_named()
            if self.wait_all(min(0.2, max(deadline - time.monotonic(), 0.0))):
                return True
        self.poll()
        return all(w.code is not None for w in self.workers)

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if all(w.code is not None for w in self.workers):
                return True
            self.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))
        return False

    def sleep(self, seconds: float) -> None:
        """Sleeps ``seconds``, or less: until a running process ends (its pidfd), so an exit is seen at once."""
        fds = [w.pidfd for w in self.workers if w.code is None and w.pidfd is not None]
        if not fds:
            time.sleep(seconds)
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(seconds * 1000)

    def stop_all(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds, to every process still running."""
        self.poll()
        for w in self.workers:
            w.unresponsive = w.code is None
        self.signal_all(signal.SIGTERM)
        if not self.wait_all(grace):
            self.signal_all(signal.SIGKILL)
            self.wait_all(30)
        self.finish_output()

    def notes(self) -> dict[int, dict]:
        """What the processes told this launcher (``jddp.runtime.watchdog.Watchdog.note``), by process index: the
        peers a process found silent, the cause it found (a collective made by a subset of the processes), an early
        end. Notes of an earlier attempt are removed when the next starts."""
        found: dict[int, dict] = {}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.note_dir):
                match = NOTE_GLOB.fullmatch(name)
                if match is None:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    with open(os.path.join(self.note_dir, name)) as f:
                        note = json.load(f)
                    if isinstance(note, dict):
                        found[int(match.group(1))] = note
        return found

    def clear_notes(self) -> None:
        with contextlib.suppress(OSError):
            for name in os.listdir(self.note_dir):
                if NOTE_GLOB.fullmatch(name):
                    os.remove(os.path.join(self.note_dir, name))

    def stop_silent(self, silent: set[int], by: str) -> None:
        """Stops at once the processes of this node that a survivor found silent for the peer timeout (SIGKILL:
        stopped or holding the GIL, a silent process acts on no SIGTERM), instead of waiting for them first."""
        self.poll()
        for w in self.workers:
            if w.process_id in silent and w.code is None:
                w.unresponsive = True
                self.output.say(f"process {w.process_id} was found silent by {by}: stopping it (SIGKILL)")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(w.popen.pid, signal.SIGKILL)

    def silent_named(self) -> None:
        """Acts on the processes' notes of silent peers (``stop_silent``)."""
        for p, note in sorted(self.notes().items()):
            silent = {q for q in note.get("silent") or [] if isinstance(q, int)}
            if silent & {w.process_id for w in self.workers if w.code is None}:
                self.stop_silent(silent, f"process {p}")

    def finish_output(self, *, wait: bool = True) -> None:
        """Ends what is left of the group and copies the rest of its output; without ``wait`` the copying goes on
        while the launcher goes on (a restart need not wait for it), joined when the launcher ends."""
        self.signal_all(signal.SIGKILL)  # leftovers of exited processes would hold the pipes open
        for w in self.workers:
            if wait:
                for reader in w.readers:
                    reader.join(timeout=5)
            else:
                self.draining += w.readers

    # -- signals ------------------------------------------------------------
    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # No printing here: the handler may interrupt `say`, which holds the output lock.
        if self.signal_received is not None:
            self.signal_all(signal.SIGKILL)
            return
        self.signal_received = signum
        self.signal_all(signum)

    def stop_after_signal(self, signum: int) -> None:
        timeout = self.config.term_timeout
        self.output.say(f"got {signal.Signals(signum).name}; forwarded it to every process")
        self.signal_all(signum)  # processes started while the signal arrived get it too
        if not self.wait_all(timeout):
            self.output.say(f"processes still running {timeout:g} s after the signal: SIGKILL")
            self.signal_all(signal.SIGKILL)
            self.wait_all(30)
        self.finish_output()

    # -- --transport mpi: the group under mpiexec ------------------------------
    def run_mpi(self) -> int:
        """Runs the group as one ``mpiexec -n N`` per attempt: MPI's process manager (hydra) starts the processes,
        prefixes their lines with their rank and ends the group when one is killed (naming its pid and signal); a
        process that exits early is named by the others' watchdogs (exit 69), as under the gloo transport."""
        c = self.config
        try:
            mpiexec = find_mpiexec()
        except FileNotFoundError as error:
            self.output.say(str(error))
            return 1
        for attempt in range(c.max_restarts + 1):
            # Not `python -u`: unbuffered, print() writes a line and its end apart, and mpiexec prefixes
            # each write with the rank; jddp.initialize() makes the streams line-buffered instead.
            argv = [mpiexec, "-n", str(c.nprocs), "-prepend-rank", *(a for a in command(c) if a != "-u")]
            env = mpi_environment(c, attempt)
            if self.snapshot_dir is not None:
                env[ENV_SNAPSHOT_DIR] = self.snapshot_dir
            popen = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            worker = _Worker(0, popen)
            self.workers = [worker]
            for pipe, target, native in ((popen.stdout, sys.stdout, True), (popen.stderr, sys.stderr, False)):
                reader = threading.Thread(
                    target=self.output.pump, args=(pipe, target, b""), kwargs={"native": native}, daemon=True
                )
                reader.start()
                worker.readers.append(reader)
            self.output.say(
                f"started {c.nprocs} processes under {mpiexec} (attempt {attempt + 1} of {c.max_restarts + 1}, "
                f"transport mpi): {' '.join(argv[4:])}"
            )
            while popen.poll() is None and self.signal_received is None:
                time.sleep(c.monitor_interval)
            if self.signal_received is not None:
                self.stop_after_signal(self.signal_received)
                code = popen.returncode
                return exitcodes.EXIT_PREEMPTED if code == exitcodes.EXIT_PREEMPTED else 128 + self.signal_received
            self.finish_output()
            code = popen.returncode
            if code in (0, exitcodes.EXIT_PREEMPTED):
                return code
            what = exitcodes.describe(code)
            if attempt < c.max_restarts:
                restarts = f"{attempt + 1} of {c.max_restarts}"
                self.output.say(f"the group under mpiexec {what}; restarting it ({restarts})")
                continue
            self.output.say(f"the group under mpiexec {what}; no restart left (--max-restarts {c.max_restarts})")
            return 128 - code if code < 0 else code
        raise AssertionError("unreachable: the last attempt returns")

    # -- the run ------------------------------------------------------------
    def summary(self, first_failed: _Worker | None) -> str:
        def describe(w: _Worker) -> str:
            if w.code is None:  # it outlived SIGKILL and the 30 s wait after it
                return "still running"
            if w is first_failed and w.code == 0:
                return "exited 0 while its peers still needed it (the cause, below)"
            if w.stopped_for_restart:
                return "stopped by the launcher for the restart (SIGKILL)"
            if w.unresponsive:
                how = exitcodes.describe(w.code)
                return f"did not end with the group (frozen or stuck), stopped by the launcher: {how}"
            return exitcodes.describe(w.code)

        lines = [f"process {w.process_id} (pid {w.popen.pid}): {describe(w)}" for w in self.workers]
        if first_failed is not None and first_failed.code == exitcodes.EXIT_STALLED:
            lines.append(
                "the group stalled: each process's last line above names the process that was behind and where, "
                "and each wrote a flight record (jddp.runtime.progress)"
            )
        elif first_failed is not None and first_failed.code == 0:
            lines.append(f"first failure: {early_exit(first_failed)}")
        elif first_failed is not None:
            lines.append(f"first failure: process {first_failed.process_id}, {describe(first_failed)}")
        elif self.reports is not None and self.reports.reports(self.attempt):
            said = "; ".join(f"node {r.node}: {r.what}" for r in self.reports.reports(self.attempt))
            lines.append(f"first failure on another node ({said})")
        notes = self.notes()
        if first_failed is not None and first_failed.code == exitcodes.EXIT_PEER_LOST:
            said = notes.get(first_failed.process_id, {}).get("reason")
            if isinstance(said, str):  # whom it lost and why, in its own words (another node's process, maybe)
                lines.append(f"process {first_failed.process_id} said: {said}")
        causes: dict[str, list[int]] = {}
        for p, note in sorted(notes.items()):
            if isinstance(note.get("cause"), str):
                causes.setdefault(note["cause"], []).append(p)
        for cause, found_by in causes.items():
            lines.append(f"cause, as process(es) {found_by} found it: {cause}")
        return "\n  ".join(["summary:", *lines])

    def first_failure(self) -> _Worker | None:
        """Of the processes found failed in this round, a killed one is the likeliest cause, then one that failed
        by itself, then one the launcher had to stop (frozen or stuck), and one that lost a peer the least likely."""
        failed = [
            (w, w.code)
            for w in self.workers
            if w.code is not None and w.code not in (0, exitcodes.EXIT_PREEMPTED) and not w.stopped_for_restart
        ]
        if not failed:
            return None
        first = min(failed, key=lambda wc: (exitcodes.is_peer_failure(wc[1]), wc[0].unresponsive, wc[1] >= 0))[0]
        if exitcodes.is_peer_failure(first.code or 0):
            # Only processes that lost a peer: the cause is one that ended normally (exit 0) while they still
            # needed it, e.g. a script that returned early. It waits at its exit for the others, so its own exit
            # can come after theirs: any exit 0 of the round counts.
            early = [w for w in self.workers if w.code == 0]
            if early:
                return min(early, key=lambda w: w.ended or 0.0)
        return first

    def run_once(self, attempt: int) -> tuple[str, _Worker | None]:
        """Runs one attempt; returns ("ok" | "failed" | "preempted" | "signal", the first failed process)."""
        try:
            self.start(attempt)
            self.attempt = attempt
            outcome, first_failed = self.watch()
            if outcome == "failed" and self.config.node_rank > 0:
                self.report(attempt, first_failed)
            if (
                outcome == "failed"
                and self.service is not None
                and self.config.nnodes > 1
                and first_failed is not None
                and not exitcodes.is_peer_failure(first_failed.code or 0)
            ):
                self.linger()
            return outcome, first_failed
        finally:
            # A local run's next service listens on another port: this one stops in the background.
            self.stop_service(wait=self.config.coordinator is not None)
            self.previous_end = time.time()

    def report(self, attempt: int, first_failed: _Worker | None) -> None:
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
        silent = sorted({q for note in self.notes().values() for q in note.get("silent") or [] if isinstance(q, int)})
        report = reports.Report(self.config.node_rank, attempt, code, what, tuple(silent))
        reports.send(reports.address(net.split_address(self.config.coordinator)), report)

    def linger(self) -> None:
        """After a failure of this node's own, keeps the service up while the other nodes' processes find it by
        themselves: without it they would only see the coordinator gone, not which process failed. Ends early once
        every other node's launcher has reported its end."""

        def all_reported() -> bool:
            return self.reports is not None and len(self.reports.reports(self.attempt)) == self.config.nnodes - 1

        if all_reported():
            return
        wait = (self.config.peer_timeout or DEFAULT_PEER_TIMEOUT_S) + 5
        self.output.say(f"keeping the coordination service up {wait:g} s for the other nodes' processes to end")
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self.signal_received is None:
            if all_reported():
                self.output.say("every other node's launcher reported its processes ended")
                return
            time.sleep(0.1)

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

    def stop_for_restart(self) -> None:
        """A restart follows: the others' end can tell nothing the launcher does not know already, and waiting for
        them to notice (the peer timeout) is downtime. SIGKILL, not SIGTERM: a SIGTERM is a preemption, whose save
        needs the process that is gone. A kill never damages a published checkpoint; a save in flight is cleaned up
        when the next attempt opens the directory."""
        self.poll()
        for w in self.workers:
            w.stopped_for_restart = w.code is None
        self.signal_all(signal.SIGKILL)
        self.wait_all(30)
        self.finish_output(wait=False)

    def remote_failure(self) -> bool:
        """Node 0 of several: acts on the other launchers' reports of a failed attempt (``jddp.cli.reports``);
        returns whether this node's processes were stopped for it.

        With a restart to follow, they are stopped at once. Otherwise they get the time they would get after a
        failure here, to end by themselves and name what they lost: the peer timeout + 5 s when the first failure
        there was a process of that node's own, 5 s when it was a lost peer (then a process of this node is the one
        lost: still running after that, it is the frozen one).
        """
        elsewhere = self.reports.reports(self.attempt) if self.reports is not None else []
        if not elsewhere or all(w.code is not None for w in self.workers):
            return False
        said = "; ".join(f"node {r.node}: {r.what}" for r in elsewhere)
        for r in elsewhere:  # a process of this node that a survivor there found silent: stopped at once
            self.stop_silent(set(r.silent), f"a process of node {r.node}")
        if self.attempt < self.config.max_restarts:
            self.output.say(f"the group failed on another node ({said}); a restart follows: stopping this node's")
            self.stop_for_restart()
            return True
        if self.remote_deadline is None:
            own = any(not exitcodes.is_peer_failure(r.code) for r in elsewhere)
            wait = (self.config.peer_timeout or DEFAULT_PEER_TIMEOUT_S) + 5 if own else PEER_LOST_WAIT_S
            self.remote_deadline = time.monotonic() + wait
            self.output.say(
                f"the group failed on another node ({said}); waiting up to {wait:g} s for this node's processes "
                "to end, then stopping them"
            )
        if time.monotonic() < self.remote_deadline:
            return False
        self.stop_all(self.config.kill_grace)
        self.poll()
        return True

    def watch(self) -> tuple[str, _Worker | None]:
        """Watches the started processes until they all ended; returns as ``run_once`` does."""
        self.probed_at, self.service_answered, self.service_silent_since = 0.0, False, None
        self.remote_deadline: float | None = None
        while True:
            if self.signal_received is not None:
                self.stop_after_signal(self.signal_received)
                return "signal", None
            self.poll()
            self.silent_named()
            if self.remote_failure():
                return "failed", self.first_failure()
            if self.service_gone() and any(w.code is None for w in self.workers):
                self.output.say(
                    f"the coordination service at {self.config.coordinator} has not answered for "
                    f"{SERVICE_GONE_S:g} s: the group has ended on node 0; stopping this node's processes"
                )
                self.stop_all(self.config.kill_grace)
                self.poll()
                return "failed", self.first_failure()
            first_failed = self.first_failure()
            if first_failed is not None:
                assert first_failed.code is not None  # first_failure picks among processes that exited
                what = exitcodes.describe(first_failed.code)
                if first_failed.code == 0:
                    what = "exited 0 while its peers still needed it (it returned early or called sys.exit(0))"
                # The others end by themselves within the peer timeout, each naming what it lost (exit 69);
                # signals only for those that do not. When the first to end lost a peer, the others that lost it
                # judge the same silence and end within a watchdog round; whoever is still running after that is
                # the frozen one.
                if self.attempt < self.config.max_restarts and not exitcodes.is_peer_failure(first_failed.code):
                    self.output.say(f"process {first_failed.process_id} {what}; a restart follows: stopping the others")
                    self.stop_for_restart()
                    return "failed", first_failed
                wait = (self.config.peer_timeout or DEFAULT_PEER_TIMEOUT_S) + 5
                if first_failed.code == exitcodes.EXIT_PEER_LOST:  # not SIGABRT: gloo aborts a process at once
                    wait = PEER_LOST_WAIT_S
                self.output.say(
                    f"process {first_failed.process_id} {what}; waiting up to {wait:g} s for the others to end, "
                    "then stopping them"
                )
                if not self.wait_silent(wait):
                    self.stop_all(self.config.kill_grace)
                self.poll()
                return "failed", self.first_failure() or first_failed
            if all(w.code is not None for w in self.workers):
                self.finish_output()
                if any(w.code == exitcodes.EXIT_PREEMPTED for w in self.workers):
                    return "preempted", None
                early = [w for w in self.workers if self.notes().get(w.process_id, {}).get("early")]
                if early:  # exited 0, but its peers (on other nodes) stopped waiting for it: the run failed
                    return "failed", min(early, key=lambda w: w.ended or 0.0)
                return "ok", None
            self.prepare_restart()
            self.spares_ready()
            self.sleep(self.config.monitor_interval)

    def exit_code(self, outcome: str, first_failed: _Worker | None) -> int:
        """The launcher's exit code after the last attempt ended with ``outcome``."""
        preempted = exitcodes.EXIT_PREEMPTED
        if outcome == "ok":
            return 0
        if outcome == "preempted":
            self.output.say(f"the run stopped on preemption (exit {preempted}); run again to resume")
            return preempted
        if outcome == "signal":
            codes = {w.code for w in self.workers}
            if codes <= {0, preempted}:
                return preempted if preempted in codes else 0
            self.output.say(self.summary(None))
            assert self.signal_received is not None  # run_once returns "signal" only once one arrived
            return 128 + self.signal_received
        self.output.say(f"{self.summary(first_failed)}\nno restart left (--max-restarts {self.config.max_restarts})")
        if first_failed is None:  # the group failed on another node, and this node's processes ended without fault
            return exitcodes.EXIT_PEER_LOST
        assert first_failed.code is not None  # first_failure picks among processes that exited
        code = first_failed.code
        if code == 0:
            # The cause ended normally, early (first_failure picks a process that exited 0 only when every failure
            # was a lost peer): the run failed all the same, with the code of the first peer it left (69).
            left = [w for w in self.workers if w.code not in (None, 0, exitcodes.EXIT_PREEMPTED)]
            code = min(left, key=lambda w: w.ended or 0.0).code if left else exitcodes.EXIT_PEER_LOST
            assert code is not None
        return 128 - code if code < 0 else code

    def run(self) -> int:
        c = self.config
        try:
            snapshot_dir = envvars.get(ENV_SNAPSHOT_DIR)  # the user's own, if set
        except ValueError as error:
            self.output.say(str(error))
            return 1
        if c.nnodes > 1 and c.node_rank == 0:
            assert c.coordinator is not None  # --nnodes > 1 requires it
            try:
                self.reports = reports.ReportServer(*reports.address(net.split_address(c.coordinator)), c.nnodes)
            except OSError as error:
                self.output.say(str(error))
                return 1
        previous = {s: signal.signal(s, self.on_signal) for s in FORWARDED_SIGNALS}
        try:
            self.make_snapshot_dir(snapshot_dir)
            if c.transport == "mpi":
                return self.run_mpi()
            attempt = 0
            while True:
                try:
                    outcome, first_failed = self.run_once(attempt)
                except OSError as error:  # the coordination service could not start (its workers were stopped)
                    self.output.say(str(error))
                    return 1
                if outcome == "failed" and attempt < self.config.max_restarts and self.signal_received is None:
                    attempt += 1
                    restarts = f"{attempt} of {self.config.max_restarts}"
                    self.output.say(f"{self.summary(first_failed)}\nrestarting the group ({restarts})")
                    continue
                return self.exit_code(outcome, first_failed)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            from jddp import goodput  # no JAX, no NumPy

            goodput.mark_teardown(os.path.join(self.note_dir, "ledger"))
            self.discard_spares()
            if self.adopt_next_service() is not None:  # started for a restart that did not come
                self.stop_service(wait=False)
            for thread in self.reapers + self.draining:
                thread.join(timeout=10)
            for w in self.workers:
                if w.pidfd is not None:
                    os.close(w.pidfd)
                    w.pidfd = None
            shutil.rmtree(self.note_dir, ignore_errors=True)
            if self.own_snapshot_dir and self.snapshot_dir is not None:
                shutil.rmtree(self.snapshot_dir, ignore_errors=True)
            if self.snapshot_lock is not None:
                os.close(self.snapshot_lock)
            if self.reports is not None:
                self.reports.close()

    def make_snapshot_dir(self, user_dir: str | None) -> None:
        """The run's snapshot directory (``JDDP_SNAPSHOT_DIR``): the user's when set (kept), else one in memory made
        here and removed when the launcher ends; leftovers of launchers of this host that no longer run are removed
        first."""
        if user_dir is not None:
            self.snapshot_dir = user_dir
            return
        base = snapshot_base()
        for path in sweep_snapshots(base):
            self.output.say(f"removed {path}, the snapshot directory of a launcher that no longer runs")
        self.snapshot_dir, self.snapshot_lock = make_locked_dir(base)
        self.own_snapshot_dir = True


def early_exit(w: _Worker) -> str:
    """What the summary says of a process that exited 0 while its peers still needed it (the cause of their 69)."""
    at = time.strftime("%H:%M:%S", time.localtime(w.ended_at)) if w.ended_at is not None else "an unknown time"
    return (
        f"process {w.process_id} exited 0 at {at} while its peers still needed it: it returned early or called "
        "sys.exit(0) (a loop that ended, or a branch taken on this process only), and the others, waiting for it in "
        "a step, stopped (exit 69). Every process must run the same steps to the end; a run that failed on this "
        "is not finished"
    )


def mpi_environment(config: LaunchConfig, attempt: int) -> dict[str, str]:
    """The environment of ``mpiexec`` under ``--transport mpi``: no ``JDDP_*`` group variables (each process joins by
    its MPI rank), the transport, and the launcher's other settings."""
    env = dict(os.environ)
    for name in ("JDDP_COORDINATOR", "JDDP_NUM_PROCESSES", "JDDP_PROCESS_ID", "JDDP_LOCAL_DEVICES"):
        env.pop(name, None)
    env.update(
        JDDP_TRANSPORT="mpi",
        JDDP_RESTART_COUNT=str(attempt),
        JDDP_MAX_RESTARTS=str(config.max_restarts),
    )
    env.pop("PYTHONUNBUFFERED", None)
    if config.peer_timeout is not None:
        env["JDDP_PEER_TIMEOUT"] = str(config.peer_timeout)
    if config.malloc_tuning and "GLIBC_TUNABLES" not in env:
        env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    return env


def find_mpiexec() -> str:
    """The ``mpiexec`` beside this Python (the mpich wheel's), else on PATH.

    Raises:
      FileNotFoundError: none found, naming the extra to install.
    """
    here = os.path.dirname(sys.executable)
    found = shutil.which("mpiexec", path=here) or shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            f"--transport mpi needs MPI's mpiexec, found neither beside {sys.executable} nor on PATH. Install "
            'jddp\'s MPI extra: pip install mpich, then pip install "jddp[mpi]" (docs/guides/launch.md, MPI).'
        )
    return found


def launch(config: LaunchConfig) -> int:
    """Runs ``config``'s target as a group of processes, restarting the group on failure, until it ends.

    Returns:
      The exit code of the run: 0, ``jddp.EXIT_PREEMPTED``, the first failed process's code, or ``128 + signal``
      (see the module docstring).
    """
    return _Launcher(config).run()


def main(argv: list[str] | None = None, *, prog: str = "jddp launch") -> int:
    """``jddp launch``: parses ``argv`` (default ``sys.argv[1:]``), launches, returns the exit code.

    Bad flags exit with code 2 and the message, before anything starts.
    """
    parser = get_args_parser(prog)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    return launch(config)
