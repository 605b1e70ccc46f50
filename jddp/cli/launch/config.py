"""The launcher's arguments: its flags (``get_args_parser``), the checked ``LaunchConfig`` they make, and the command
line of every process."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from jddp import envvars, net, placement
from jddp.cli import reports

DEFAULT_PEER_TIMEOUT_S: float = envvars.VARIABLES["JDDP_PEER_TIMEOUT"].default  # distributed's (no JAX here)
DEFAULT_STANDBY_DEPTH = 2  # see the manual's "Standby"
DEFAULT_STANDBY_NICE = 0


def get_args_parser(prog: str = "jddp launch") -> argparse.ArgumentParser:
    """The launcher's flags, then the script (or module with ``-m``) and the arguments passed through to it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Start a data-parallel JAX run as several processes; restart it when one fails.",
        epilog="The manual is the docstring of jddp/cli/launch/__init__.py "
        "(python -c 'import jddp.cli.launch; help(jddp.cli.launch)').",
    )
    parser.add_argument(
        "-n",
        "--nprocs",
        "--nproc-per-node",
        type=envvars.process_count(),
        default="auto",
        metavar="N|auto|device|host",
        help="processes on this node: N, one per accelerator (device), one owning all devices (host), or auto: "
        "device on GPUs, host on TPUs and CPUs (default auto; see jddp.placement)",
    )
    parser.add_argument(
        "--devices-per-process",
        type=envvars.count(1),
        default=None,
        metavar="D",
        help="simulated CPU devices in each process, CPU only (default: none simulated; $JDDP_LOCAL_DEVICES if set, "
        "else the devices JAX finds)",
    )
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="address of process 0's coordination service (default 127.0.0.1 and a free port; required with --nnodes)",
    )
    parser.add_argument(
        "--nnodes",
        type=envvars.node_range(),
        default="1",  # a string: argparse converts it as it converts the flag's value
        metavar="N|MIN:MAX",
        help="number of hosts, one launcher on each (default 1); MIN:MAX: elastic membership, the group re-forms "
        "without a lost host and admits one that (re)joins, between MIN and MAX hosts (see the manual)",
    )
    parser.add_argument(
        "--node-rank",
        type=envvars.count(0),
        default=None,
        help="index of this host, 0 to nnodes-1 (default 0; not with --nnodes MIN:MAX: the rendezvous numbers them)",
    )
    parser.add_argument(
        "--join-timeout",
        type=envvars.seconds(),
        default=600.0,
        metavar="S",
        help="with --nnodes MIN:MAX, seconds to wait for MIN hosts at the start, or for node 0 to answer, before "
        "failing (default 600)",
    )
    parser.add_argument(
        "--join-wait",
        type=envvars.seconds(),
        default=10.0,
        metavar="S",
        help="with --nnodes MIN:MAX, seconds the first round waits for up to MAX hosts once MIN have joined "
        "(default 10)",
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
        "--job-token-file",
        default=None,
        metavar="PATH",
        help="with --nnodes > 1: a file (mode 600) whose first line is the job's token; every launcher of the run "
        "must prove the same token (default: $JDDP_JOB_TOKEN, else derived, see jddp.cli.job_token)",
    )
    parser.add_argument(
        "--flush-grace",
        type=envvars.seconds(),
        default=1.0,
        metavar="S",
        help="before a restart kills the surviving processes: seconds between the flush signal (SIGUSR2: they write "
        "out their buffered files, logs and stdout, see jddp.runtime.flush) and SIGKILL (default 1)",
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
        "--init-timeout",
        type=envvars.seconds(),
        default=None,
        metavar="S",
        help="the start-up timeout: seconds to form the group and for every process to reach each jddp program's "
        "first run (default: $JDDP_INIT_TIMEOUT if set, else 120)",
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
        "--standby-depth",
        type=envvars.count(1),
        default=DEFAULT_STANDBY_DEPTH,
        metavar="K",
        help="with standby, the next K attempts' processes stand by at once, so that a second failure soon after a "
        "restart finds a group standing by too; each generation is nprocs more processes holding the compiled "
        "step (default %(default)s)",
    )
    parser.add_argument(
        "--standby-nice",
        type=envvars.count(0),
        default=DEFAULT_STANDBY_NICE,
        metavar="N",
        help="autogroup nice value (0 to 19) of spare and standby processes while they import and compile, 0 again "
        "once they stand by or take a role; where autogroups are on (a process in the root CPU cgroup), else "
        "nothing (default %(default)s)",
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
    flush_grace: float = 1.0  # seconds between the flush signal and SIGKILL (jddp.runtime.flush)
    job_token_file: str | None = None  # the job's token in a file (jddp.cli.job_token); None: $JDDP_JOB_TOKEN, ...
    peer_timeout: float | None = None  # seconds before a silent peer counts as dead (JDDP_PEER_TIMEOUT)
    init_timeout: float | None = None  # the start-up timeout (JDDP_INIT_TIMEOUT)
    malloc_tuning: bool = True  # set GLIBC_TUNABLES for the processes unless already set
    cpu_share: bool = False  # each process its share of this node's cores (affinity, XLA and OpenMP threads)
    spares: bool = True  # with max_restarts > 0, spare processes with the imports done wait for a restart
    standby: bool = True  # spares run the next attempt's script up to its restore (one node, own coordinator)
    standby_depth: int = DEFAULT_STANDBY_DEPTH  # generations standing by: the next K attempts'
    standby_nice: int = DEFAULT_STANDBY_NICE  # autogroup nice of spares while they prepare (jddp.cli.launch.spares)
    transport: str = "xla"  # "mpi": the processes run under mpiexec and sum through MPI (jddp.engine.mpi)
    min_nodes: int | None = None  # --nnodes MIN:MAX: elastic membership (jddp.cli.launch.rendezvous); None: fixed
    max_nodes: int | None = None
    join_timeout: float = 600.0  # elastic: seconds to wait for MIN nodes at the start, or for node 0 to answer
    join_wait: float = 10.0  # elastic: seconds the first round waits for up to MAX nodes once MIN joined
    process_offset: int | None = None  # elastic: this round's first process id here (None: node_rank * nprocs)
    world: int | None = None  # elastic: this round's processes over all nodes (None: nnodes * nprocs)
    # This host's platform and each local process's devices (jddp.placement); CPU and no placements when built
    # directly (`config_from_args` reads the host).
    platform: str = "cpu"
    placements: tuple[placement.Placement, ...] = ()

    @property
    def elastic(self) -> bool:
        """``--nnodes MIN:MAX``: the rendezvous decides each round's membership."""
        return self.min_nodes is not None

    def first_process_id(self) -> int:
        """The process id of this node's local rank 0 (this round's, when elastic)."""
        return self.node_rank * self.nprocs if self.process_offset is None else self.process_offset

    def num_processes(self) -> int:
        """The group's processes over all nodes (this round's, when elastic)."""
        return self.nnodes * self.nprocs if self.world is None else self.world

    def __post_init__(self) -> None:
        if self.nprocs < 1:
            raise ValueError(f"-n/--nprocs must be at least 1, got {self.nprocs}.")
        if self.devices_per_process is not None and self.devices_per_process < 1:
            raise ValueError(f"--devices-per-process must be at least 1, got {self.devices_per_process}.")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be at least 1, got {self.nnodes}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank={self.node_rank} must be in [0, --nnodes={self.nnodes}).")
        if self.min_nodes is not None or self.max_nodes is not None:
            low, high = self.min_nodes, self.max_nodes
            if not (isinstance(low, int) and isinstance(high, int) and 1 <= low < high):
                raise ValueError(f"--nnodes MIN:MAX must have 1 <= MIN < MAX, got {low}:{high}.")
            if self.coordinator is None:
                raise ValueError(
                    f"--nnodes {low}:{high} needs --coordinator HOST:PORT: an address of the host that runs the "
                    "rendezvous (the first launcher started there hosts it) that every node can reach."
                )
            if self.transport != "xla":
                raise ValueError(f"--nnodes {low}:{high} (elastic) needs --transport xla: MPI's world is fixed.")
        if self.nnodes > 1 and self.coordinator is None:
            raise ValueError(
                "--nnodes > 1 needs --coordinator HOST:PORT: an address of node 0 that every node can reach."
            )
        if self.coordinator is not None:
            _, port = net.split_address(self.coordinator, name="--coordinator")
            if (self.nnodes > 1 or self.elastic) and port + reports.PORT_OFFSET > 65535:
                raise ValueError(
                    f"--coordinator {self.coordinator}: with --nnodes > 1 node 0's launcher also listens on the "
                    f"coordinator's port + 1 (the other launchers report there), so the port must be below 65535."
                )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}.")
        if self.standby_depth < 1:
            raise ValueError(
                f"--standby-depth must be at least 1, got {self.standby_depth} (no standby at all: --no-standby)."
            )
        if not 0 <= self.standby_nice <= 19:
            raise ValueError(f"--standby-nice must be a nice value from 0 to 19, got {self.standby_nice}.")
        for name in (
            "monitor_interval",
            "kill_grace",
            "term_timeout",
            "flush_grace",
            "peer_timeout",
            "init_timeout",
            "join_timeout",
            "join_wait",
        ):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                flag = name.replace("_", "-")
                raise ValueError(f"--{flag} must be a positive, finite number of seconds, got {value}.")
        if self.transport not in ("xla", "mpi"):
            raise ValueError(f"--transport must be xla or mpi, got {self.transport!r}.")
        if self.placements and len(self.placements) != self.nprocs:
            raise ValueError(f"{len(self.placements)} placements for -n {self.nprocs} processes.")
        if self.platform != "cpu" and self.cpu_share:
            raise ValueError(
                f"--cpu-share pins XLA:CPU's compute threads to each process's cores; on this {self.platform} host the "
                "devices compute and the host threads only feed them. Drop --cpu-share."
            )
        if self.transport == "mpi" and (self.nnodes > 1 or (self.devices_per_process or 1) > 1 or self.cpu_share):
            raise ValueError(
                "--transport mpi runs one device per process on this node under MPI's own launcher: drop --nnodes, "
                "--devices-per-process and --cpu-share (for several hosts, start the processes with mpiexec's "
                "-hosts or with srun; jddp.initialize() joins the MPI world)."
            )
        if not self.module and not os.path.exists(self.target):
            raise ValueError(f"script {self.target!r} does not exist (use -m to run a module).")


def config_from_args(args: argparse.Namespace, inventory: placement.Inventory | None = None) -> LaunchConfig:
    """The ``LaunchConfig`` of parsed flags, its processes placed on ``inventory`` (default: this host's,
    ``jddp.placement.inventory()``).

    On an accelerator the standby processes are off (``standby=False``): a standby process initialises the backend
    and compiles on the device of the process it stands behind, which that live process holds (XLA preallocates
    75% of it), so it would fail or take the live process's memory. Spares stay: they import JAX and the libraries,
    which initialises no backend and takes no device memory.

    Raises:
      ValueError: as ``LaunchConfig`` does, when a flag's value is out of range, or as ``jddp.placement.place``
        does, when the processes cannot be placed on this host's devices.

    Example:
      >>> config = config_from_args(get_args_parser().parse_args(["-n", "2", "-m", "train", "steps=10"]))
      >>> config.nprocs, config.module, config.target, config.target_args
      (2, True, 'train', ('steps=10',))
    """
    options = dict(vars(args))  # the flags' names are the fields' names, but for these six
    target_args, no_malloc_tuning = options.pop("args"), options.pop("no_malloc_tuning")
    no_spares, no_standby = options.pop("no_spares"), options.pop("no_standby")
    low, high = options.pop("nnodes")
    if low != high:  # MIN:MAX: elastic; each round's nnodes and node rank come from the rendezvous
        if options["node_rank"] is not None:
            raise ValueError(
                f"--node-rank is not for --nnodes {low}:{high}: with elastic membership the rendezvous numbers the "
                "nodes of every round (the host that runs it is node 0). Drop --node-rank."
            )
        options.update(min_nodes=low, max_nodes=high)
    options["node_rank"] = options["node_rank"] or 0
    inventory = placement.inventory() if inventory is None else inventory
    placed = placement.place(options["nprocs"], inventory, devices_per_process=options["devices_per_process"])
    options["nprocs"] = len(placed)
    return LaunchConfig(
        target_args=tuple(target_args),
        malloc_tuning=not no_malloc_tuning,
        spares=not no_spares,
        standby=not no_standby and inventory.platform == "cpu",
        nnodes=low if low == high else high,
        platform=inventory.platform,
        placements=placed,
        **options,
    )


def command(config: LaunchConfig) -> list[str]:
    """The command line of every process: ``python -u [-m] target *target_args``."""
    return [sys.executable, "-u", *(["-m"] if config.module else []), config.target, *config.target_args]
