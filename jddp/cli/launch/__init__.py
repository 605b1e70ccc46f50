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

    # elastic: 2 to 3 hosts, the same line on each (the first started on 10.0.0.1 is node 0)
    jddp launch -n 4 --nnodes 2:3 --coordinator 10.0.0.1:29500 train.py

    # a GPU host: one process per GPU (-n auto, the default), or one owning them all (-n host)
    jddp launch train.py

Placement (``jddp.placement``): ``-n`` is a count, or ``auto`` (the default: one process per GPU on a GPU
host, one process on a TPU or CPU host), ``device`` or ``host``. The launcher reads the host's accelerators without
starting JAX and gives each process its own through the driver (``CUDA_VISIBLE_DEVICES``,
``HIP_VISIBLE_DEVICES``), with ``JDDP_PLATFORM`` and ``JDDP_DEVICES``. On an accelerator the CPU-only defaults are
off: the allocator settings below, gloo, ``--cpu-share`` (refused) and standby processes (spares stay).

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
node 0 would otherwise never learn that the group ended elsewhere. On a CPU host, unless
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
``--monitor-interval`` poll), SIGKILLs the others, and starts the next attempt without waiting for the old group's
last output (it is still copied, while the next attempt runs; all of it before the launcher exits) or for the old
coordination service to stop (a local run's next service listens on a new port: started, with the spares, while the
attempt before it runs). With ``--max-restarts`` > 0 and an attempt's processes past their first step (their
goodput ledger says so; else ``PREPARE_AFTER_S`` seconds after the attempt started; at once in an attempt woken
from standby), the launcher starts one spare per local process (``python -u -m jddp.cli.spare``, see there): a
process that has imported JAX, Flax, Optax, Orbax, Grain and jddp and waits. A restart hands each spare its
process's role (the environment described above, the command) instead of starting a new process, says ``process(es)
... handed to their spares``, and starts a process anew where a spare has ended; a spare's lines get the ``[N] ``
of the role it took; spares not needed are ended with the launcher. ``--no-spares`` turns them off; ``--transport
mpi`` has none. With ``--cpu-share`` a spare is pinned to the cores of its local rank from its start, as a process
is.

Standby (one node, the launcher's own coordinator: no ``--coordinator``, ``--nnodes 1``): once the spares are
ready and the next service listens, each spare is handed its role in the next attempt at once and runs the script
up to its restore (``jddp.runtime.standby``): it joins the next attempt's group, builds the model and the data,
compiles the step, and waits. Its output is held meanwhile. A restart then wakes them (``process(es) ... woken
from standby``) and releases their output: what is left is the failed group's end and the restore. When not
every standby process stands by at the failure (one ended, or the script stands by nowhere), they and the next
service are ended and the attempt starts as without them. ``--no-standby`` keeps the spares at their imports.

Standby depth: ``--standby-depth K`` (default 2) keeps the next K attempts standing by, each a *generation* of one
process per local process and a coordination service of its own (never past ``--max-restarts``). Generations are
prepared one at a time, nearest first (imports, joining, building, compiling): attempt k + 2's spares start once
attempt k + 1's stand by, so the CPUs go first to the standby the next failure needs. An attempt woken from standby
whose next attempt has no standby prepares the next generation at once (its processes import and compile nothing);
any other attempt waits for its first step, or ``PREPARE_AFTER_S``: its start-up, or the woken processes' restore,
has the CPUs first. With depth 2 a second failure right after a restart finds attempt k + 2 already standing by: the
launcher says ``woken from standby`` again. Each generation costs memory: nprocs processes holding the model, the
optimizer state and the compiled step (290 to 400 MiB each for the MNIST-1D MLP, plus 155 MiB for its service,
measured on this 2-core machine on 2026-11-29); depth 1 halves what waits. Every generation not woken is ended with
the run (SIGKILL to each process's session, its service stopped). A failure while the next generation still
prepares, all its processes running, waits for it (up to ``STANDBY_WAIT_S``, 30 s) rather than ending it: what it
has left is less than what processes started anew do.

Priority while preparing: ``--standby-nice N`` (default 0: off) sets the autogroup nice value of spares and
standby processes while they import and compile, and 0 again once they stand by or take a role. The launcher starts
every process in a session of its own, and where autogroups are on (``/proc/sys/kernel/sched_autogroup_enabled``,
a process in the root CPU cgroup) a session's processes share one scheduling weight: a nice value or
``SCHED_IDLE`` then changes nothing against the running attempt (measured: 50/50 of one core either way; 98.6/1.4
with the autogroup at 19). An autogroup's nice can be raised back to 0 by an unprivileged user (the kernel asks
``RLIMIT_NICE`` only below 0; one write per 100 ms per host, retried), a nice value or ``SCHED_IDLE`` cannot
(checked as uid nobody with ``RLIMIT_NICE`` 0). Off by default: a lowered standby gets almost no CPU whenever the
running attempt or anything else keeps the cores busy, so under load it is not ready before the failure it
prepares for (measured at load 8 to 12: nice 0 stood by 27.6 and 36.3 s after the start, nice 19 not within the
whole 20-epoch run; ``python -m benchmarks.standby_priority``).

The snapshot directory: each launcher makes one directory in memory for the run (under ``/dev/shm`` when it is
a tmpfs, else the temporary directory: ``jddp-snapshots-<launcher pid>-<random>``), passes it to every process
as ``JDDP_SNAPSHOT_DIR``, keeps it across attempts and removes it when it ends; one the user set in
``JDDP_SNAPSHOT_DIR`` is passed instead and never removed. A launcher that was SIGKILLed leaves its directory:
each launcher removes, when it starts, the ``jddp-snapshots-<pid>-*`` directories whose launcher no longer runs:
whose lock file no process holds (a launcher holds a ``flock`` on its directory's ``SNAPSHOT_LOCK`` while it runs,
and the kernel drops it when the launcher dies, SIGKILL included; this holds across PID namespaces that share
``/dev/shm``, where a pid names nobody or somebody else).

Elastic membership (``--nnodes MIN:MAX``): the launchers meet at node 0's rendezvous (the first launcher
started on the coordinator's host, listening at its port + 1), which numbers the nodes of each round, ends a round
at once when a node's launcher is gone, drops a node whose processes failed more than ``--max-restarts`` times,
admits a node that joins at a step every process agrees on (the preemption save), and ends the run, every launcher
exiting 69, below MIN nodes. Node 0 can be lost too: the next coordinator candidate hosts the rendezvous and the
coordination service of the next round (``jddp.cli.launch.candidates``, ``jddp.cli.launch.member``). Each process
gets ``JDDP_MEMBERSHIP``; see ``jddp.cli.launch.elastic`` and the launch
guide.

From Python: ``launch(config_from_args(get_args_parser().parse_args(argv)))``, or
``launch(LaunchConfig(target="train.py", nprocs=2))``; ``launch`` returns the exit
code described above.

The launcher imports no JAX: it only starts processes and reads their output.
This package's docstring is the launcher's manual; its modules hold one job each: ``config`` (the flags,
``LaunchConfig``), ``environment`` (what each process gets), ``workers`` (this node's processes), ``service`` (node
0's coordination service), ``spares`` (spares and standby), ``nodes`` (the other nodes: reports, node 0's service),
``notes`` (what the processes tell the launcher), ``failure`` (the first failure, the summary, the exit code),
``snapshots`` (the snapshot directory), ``mpi`` (``--transport mpi``), ``rendezvous`` (elastic membership's
protocol), ``elastic`` (the rounds of ``--nnodes MIN:MAX``), ``member`` (a node other than 0 in those rounds),
``candidates`` (node 0's successors), ``orphans`` (no process outlives its launcher), ``api`` (what those rounds
need of a launcher) and
``supervisor`` (the attempt loop, ``launch``, ``main``). The output handling is in ``jddp.cli.output``, the spares'
side in ``jddp.cli.spare``.
"""

from jddp.cli.launch.config import DEFAULT_PEER_TIMEOUT_S, LaunchConfig, command, config_from_args, get_args_parser
from jddp.cli.launch.environment import (
    ENV_COORDINATOR_HOSTED,
    ENV_SNAPSHOT_DIR,
    ENV_STDOUT_FD,
    MALLOC_TUNABLES,
    cpu_shares,
)
from jddp.cli.launch.failure import PEER_LOST_WAIT_S
from jddp.cli.launch.service import SERVICE_READY, SERVICE_STOP_SIGNAL
from jddp.cli.launch.snapshots import SNAPSHOT_LOCK, SNAPSHOT_PREFIX, make_locked_dir, sweep_snapshots
from jddp.cli.launch.spares import FORKED, SPARES_READY, STANDBY_READY
from jddp.cli.launch.supervisor import PREPARE_AFTER_S, launch, main

__all__ = [
    "DEFAULT_PEER_TIMEOUT_S",
    "ENV_COORDINATOR_HOSTED",
    "ENV_SNAPSHOT_DIR",
    "ENV_STDOUT_FD",
    "FORKED",
    "MALLOC_TUNABLES",
    "PEER_LOST_WAIT_S",
    "PREPARE_AFTER_S",
    "SERVICE_READY",
    "SERVICE_STOP_SIGNAL",
    "SNAPSHOT_LOCK",
    "SNAPSHOT_PREFIX",
    "SPARES_READY",
    "STANDBY_READY",
    "LaunchConfig",
    "command",
    "config_from_args",
    "cpu_shares",
    "get_args_parser",
    "launch",
    "main",
    "make_locked_dir",
    "sweep_snapshots",
]
