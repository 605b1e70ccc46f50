"""Joining a group of processes: ``initialize`` and ``barrier``.

``initialize()`` is the first line of a training script. What it does depends on
where the script runs:

* alone (``python train.py``): nothing, apart from simulating
  ``JDDP_LOCAL_DEVICES`` CPU devices when that variable is set;
* under ``jddp launch`` (or anything that sets the same variables): it joins the
  group described by ``JDDP_COORDINATOR`` (``host:port``),
  ``JDDP_NUM_PROCESSES``, ``JDDP_PROCESS_ID`` and ``JDDP_LOCAL_DEVICES``;
* under SLURM, Open MPI or Kubernetes (without those variables): it lets
  ``jax.distributed.initialize()`` detect the cluster.

The coordination service (JAX's key-value store, barriers and heartbeats) runs
in a process of its own: the launcher's, or, without one, a child that process
0 starts (``jddp.runtime.coordinator``), so that losing process 0 is like losing
any other. It listens on the coordinator address it is given
(``127.0.0.1:port`` for a local run), never on every interface as JAX's default
``[::]:port`` does. On CPU the collectives are gloo; without ``jddp launch``, which
drops gloo's "[Gloo] Rank ... is connected to" lines from its workers' output,
each process drops them from its own stdout. Each process prints
one preflight line: its index, the process count, its local and the global
devices, and the coordinator.

Every run, in a group or alone, prints one topology line on process 0 (to
stderr), at ``initialize`` in a group, else at the first ``data_mesh()`` or
``fit``: ``jddp: 8 devices (cpu), 1 process x 8 local devices``.

Failure detection: a watchdog thread in every process of a group ends it with
``EXIT_PEER_LOST`` (69) naming the lost peer (``jddp.runtime.watchdog``).

Environment variables (``jddp launch`` sets the first five):

* ``JDDP_COORDINATOR``, ``JDDP_NUM_PROCESSES``, ``JDDP_PROCESS_ID``;
* ``JDDP_LOCAL_DEVICES``: simulated CPU devices in this process;
* ``JDDP_PEER_TIMEOUT`` (seconds), ``JDDP_INIT_TIMEOUT`` (seconds): defaults of
  the arguments of the same names.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import socket
import sys
import threading
import time

from jddp import envvars, net, validate
from jddp.runtime import compile_cache, jax_internals, mesh, progress, watchdog
from jddp.runtime import coordinator as coordinator_lib

ENV_COORDINATOR = "JDDP_COORDINATOR"
ENV_NUM_PROCESSES = "JDDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDDP_PROCESS_ID"
ENV_LOCAL_DEVICES = "JDDP_LOCAL_DEVICES"
ENV_PEER_TIMEOUT = "JDDP_PEER_TIMEOUT"
ENV_INIT_TIMEOUT = "JDDP_INIT_TIMEOUT"
ENV_STDOUT_FD = "JDDP_STDOUT_FD"  # set by `jddp launch` (jddp.cli.launch.ENV_STDOUT_FD)
# Set by `jddp launch` (jddp.cli.launch.ENV_COORDINATOR_HOSTED): the coordination service at JDDP_COORDINATOR runs
# in a process of its own (jddp.runtime.coordinator), so process 0 joins it as a client instead of starting it.
ENV_COORDINATOR_HOSTED = "JDDP_COORDINATOR_HOSTED"

DEFAULT_PEER_TIMEOUT_S: float = envvars.VARIABLES[ENV_PEER_TIMEOUT].default  # 30 s
DEFAULT_INIT_TIMEOUT_S: float = envvars.VARIABLES[ENV_INIT_TIMEOUT].default  # 120 s
HEARTBEAT_MARGIN_S = 15


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """The group this process joined; ``initialize`` returns it."""

    coordinator: str | None
    num_processes: int
    process_id: int
    peer_timeout_s: float


_group: ProcessGroup | None = None
_barrier_counts: dict[str, int] = {}
_announced = False  # the topology line was printed (or is not this process's to print)


def topology_line() -> str:
    """``jddp: 8 devices (cpu), 1 process x 8 local devices``: the devices, the platform, the processes and each
    one's devices (starts the JAX backend)."""
    import jax

    n, processes, local = jax.device_count(), jax.process_count(), jax.local_device_count()
    return (
        f"jddp: {n} device{'s' if n != 1 else ''} ({jax.default_backend()}), {processes} "
        f"process{'es' if processes != 1 else ''} x {local} local device{'s' if local != 1 else ''}"
    )


def announce_topology() -> None:
    """Prints ``topology_line()`` to stderr on the main process, once per process: called by ``initialize`` (in a
    group), by the first ``data_mesh()`` and by ``fit``, so that every run says where it runs, also a script that
    never calls ``initialize``."""
    global _announced
    if _announced:
        return
    _announced = True
    import jax

    if jax.process_index() == 0:
        print(topology_line(), file=sys.stderr, flush=True)


def _env_int(name: str) -> int | None:
    """A variable of MPI's (``PMI_RANK``, ``PMI_SIZE``); jddp's own are read through ``jddp.envvars``."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} must be an integer.") from None


def _own_stdout() -> bool:
    """Under ``jddp launch``: ``sys.stdout`` moves to the pipe the launcher gave Python alone, so that what C++
    writes to fd 1 (gloo's chatter, from its own threads, cut anywhere) never lands inside a printed line
    (``jddp.cli.output``). Returns whether it moved (the launcher then drops the chatter)."""
    fd = envvars.get(ENV_STDOUT_FD)
    os.environ.pop(ENV_STDOUT_FD, None)
    if fd is None:
        return False
    try:
        stream = os.fdopen(fd, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8", errors="replace")
    except OSError:
        return False  # not inherited (a process started by the script itself): keep fd 1
    sys.stdout.flush()
    sys.stdout = stream
    return True


def check_joined() -> None:
    """Raises if this process was started as one of a group but never joined it.

    ``jddp launch`` sets ``JDDP_NUM_PROCESSES``; a script that never calls ``jddp.initialize()`` would otherwise
    run as N separate single-process jobs, each training on all the data and writing the same files. Called by
    jddp's entry points (``data_mesh``, ``DataParallel``, ``DataLoader``, ``Checkpointer``) before they use JAX.
    """
    if _group is not None:
        return
    raw = envvars.get(ENV_NUM_PROCESSES)
    if raw is None or raw <= 1 or _joined_elsewhere():
        return
    me = envvars.get(ENV_PROCESS_ID)
    me = "?" if me is None else me
    raise RuntimeError(
        f"This process was started as process {me} of a group of {raw} (JDDP_NUM_PROCESSES={raw}, set by "
        "`jddp launch`), but it has not joined the group: jddp.initialize() was not called, so each process "
        "would train alone on all the data. Call jddp.initialize() at the start of the script, before anything "
        "else uses JAX."
    )


def _joined_elsewhere() -> bool:
    """True if the process joined a group without jddp (``jax.distributed.initialize`` called directly)."""
    return jax_internals.distributed_client() is not None


def _wait_reachable(host: str, port: int, deadline: float, process_id: int, num_processes: int) -> None:
    last_error = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))) as c:
                _check_speaks_grpc(c, host, port)
                return
        except NotCoordinatorError:
            raise
        except OSError as e:
            last_error = e.strerror or str(e)
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"jddp.initialize: process {process_id} of {num_processes} could not reach the coordinator at "
                f"{host}:{port} within the initialisation timeout ({last_error}). Is process 0 running, and is the "
                f"address right? Raise the timeout with init_timeout_s= or {ENV_INIT_TIMEOUT}."
            )
        time.sleep(0.2)


# An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (JAX's coordination service)
# answers with a SETTINGS frame of its own (type 4 on stream 0) at once.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_ANSWER_S = 15.0


class NotCoordinatorError(ConnectionError):
    """Another program, not JAX's coordination service, answers at the coordinator address."""


def _check_speaks_grpc(connection: socket.socket, host: str, port: int) -> None:
    """Raises ``ConnectionError`` naming the address if another program, not the coordinator, answers there.

    Otherwise JAX's client waits out its whole timeout and then aborts the process from C++ (exit 134, "the
    distributed service detected fatal errors").
    """
    answer = b""
    try:
        connection.settimeout(_H2_ANSWER_S)
        connection.sendall(_H2_PREFACE)
        while len(answer) < 9:
            chunk = connection.recv(9 - len(answer))
            if not chunk:
                break
            answer += chunk
    except OSError:
        pass
    if len(answer) == 9 and answer[3] == 4 and answer[5:9] == bytes(4):
        return
    with contextlib.suppress(OSError):
        connection.settimeout(0.5)
        answer += connection.recv(64)  # more of it, for the message
    said = answer.decode("latin-1").splitlines()[0][:60] if answer else "nothing"
    raise NotCoordinatorError(
        f"jddp.initialize: the coordinator address {host}:{port} is answered by another program, not JAX's "
        f"coordination service (it answered {said!r} to an HTTP/2 greeting). Another program listens on that port: "
        "start the group on a free port (`jddp launch` picks one when --coordinator is left out), or stop that "
        "program."
    )


def _own_address_toward(host: str, port: int) -> str:
    """The local address the kernel would use to reach ``host`` (a UDP connect sends nothing)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_devices: int | None = None,
    *,
    init_timeout_s: float | None = None,
    peer_timeout_s: float | None = None,
    shutdown_timeout_s: float = 300.0,
    bind_address: str | None = None,
    verbose: bool = True,
) -> ProcessGroup | None:
    """Joins the process group, or does nothing when this is the only process.

    Args:
      coordinator: ``host:port`` of process 0's coordination service; default
        ``$JDDP_COORDINATOR``.
      num_processes: processes in the group; default ``$JDDP_NUM_PROCESSES``.
      process_id: this process's index; default ``$JDDP_PROCESS_ID``.
      local_devices: simulated CPU devices in this process; default
        ``$JDDP_LOCAL_DEVICES``, else the backend's own count.
      init_timeout_s: how long to wait for the coordinator and every peer;
        default ``$JDDP_INIT_TIMEOUT`` or 120 s.
      peer_timeout_s: a peer silent this long counts as dead (see the module
        docstring); default ``$JDDP_PEER_TIMEOUT`` or 30 s.
      shutdown_timeout_s: how long a finished process waits at exit for the
        others to finish.
      bind_address: where process 0's coordination service listens; default
        the coordinator address itself.
      verbose: print the preflight line.

    Returns:
      The ``ProcessGroup`` joined, or ``None`` for a single process.

    Raises:
      RuntimeError: if the JAX backend already started (initialise first).
      ValueError: for inconsistent or malformed settings (the message names them).
      TypeError: for a ``coordinator``, ``bind_address`` or ``verbose`` of the wrong type (named).
      TimeoutError: if the coordinator cannot be reached within ``init_timeout_s``.
      OSError: if process 0 finds the coordinator port already in use.
    """
    global _group
    _check_arguments(
        coordinator=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_devices=local_devices,
        init_timeout_s=init_timeout_s,
        peer_timeout_s=peer_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
        bind_address=bind_address,
        verbose=verbose,
    )
    launched = _own_stdout()
    if _group is not None:
        return _group
    settings = _Settings.resolve(
        coordinator, num_processes, process_id, local_devices, init_timeout_s, peer_timeout_s, bind_address
    )
    stall = progress.Settings.from_env()  # bad JDDP_STALL_* values raise here, before anything starts
    compile_cache.enable()  # restarts and reruns read their compiled programs back (jddp.runtime.compile_cache)
    if settings.single:  # nothing to join; simulate_cpu_devices raises if the backend runs with another count
        if settings.local_devices is not None:
            mesh.simulate_cpu_devices(settings.local_devices)
        return None
    _prepare_backend(settings)
    coordinator = _join(settings, shutdown_timeout_s)
    if not launched:
        # srun, mpiexec, a group set by hand: no launcher drops gloo's chatter. After _join, so that the coordination
        # service's child (process 0's) keeps the original fd 1.
        _filter_native_stdout()
    import jax

    _group = ProcessGroup(coordinator, jax.process_count(), jax.process_index(), settings.peer_timeout_s)
    client = jax_internals.distributed_client()
    progress.PROGRESS.settings = stall
    watchdog.start(client, _group.process_id, _group.num_processes, coordinator, settings.peer_timeout_s)
    if verbose:
        print(
            f"jddp: process {_group.process_id} of {_group.num_processes}: {jax.local_device_count()} local "
            f"{jax.default_backend()} device(s), {jax.device_count()} global, coordinator {coordinator}, "
            f"peer timeout {settings.peer_timeout_s:g} s",
            file=sys.stderr,
            flush=True,
        )
        announce_topology()
    return _group


def _check_arguments(
    *,
    coordinator: object,
    num_processes: object,
    process_id: object,
    local_devices: object,
    init_timeout_s: object,
    peer_timeout_s: object,
    shutdown_timeout_s: object,
    bind_address: object,
    verbose: object,
) -> None:
    """``initialize``'s own arguments, each checked by name before anything starts (the environment's values are
    checked by ``jddp.envvars`` when read)."""
    validate.check_str("coordinator", coordinator, optional=True)
    validate.check_int("num_processes", num_processes, optional=True)
    validate.check_int("process_id", process_id, minimum=0, optional=True)
    validate.check_int("local_devices", local_devices, optional=True)
    validate.check_number("init_timeout_s", init_timeout_s, optional=True, unit="seconds")
    validate.check_number("peer_timeout_s", peer_timeout_s, optional=True, unit="seconds")
    validate.check_number("shutdown_timeout_s", shutdown_timeout_s, unit="seconds")
    validate.check_str("bind_address", bind_address, optional=True)
    validate.check_bool("verbose", verbose)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """``initialize``'s arguments with the environment's defaults filled in, checked."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    local_devices: int | None
    init_timeout_s: float
    peer_timeout_s: float
    bind_address: str | None

    @classmethod
    def resolve(cls, coordinator, num_processes, process_id, local_devices, init_timeout_s, peer_timeout_s, bind):
        coordinator = coordinator if coordinator is not None else envvars.get(ENV_COORDINATOR)
        num_processes = num_processes if num_processes is not None else envvars.get(ENV_NUM_PROCESSES)
        process_id = process_id if process_id is not None else envvars.get(ENV_PROCESS_ID)
        if coordinator is None and num_processes is None and process_id is None:
            coordinator, num_processes, process_id = _from_mpi() or (None, None, None)
        local_devices = local_devices if local_devices is not None else envvars.get(ENV_LOCAL_DEVICES)
        if init_timeout_s is None:
            init_timeout_s = envvars.get(ENV_INIT_TIMEOUT)
        if peer_timeout_s is None:
            peer_timeout_s = envvars.get(ENV_PEER_TIMEOUT)
        settings = cls(coordinator, num_processes, process_id, local_devices, init_timeout_s, peer_timeout_s, bind)
        settings.check()
        return settings

    def check(self) -> None:
        for name, value in (("init_timeout_s", self.init_timeout_s), ("peer_timeout_s", self.peer_timeout_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"`{name}` must be a positive, finite number of seconds, got {name}={value!r}.")
        given = {"coordinator": self.coordinator, "num_processes": self.num_processes, "process_id": self.process_id}
        if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
            missing = [k for k, v in given.items() if v is None]
            raise ValueError(
                f"jddp.initialize got {', '.join(f'{k}={v!r}' for k, v in given.items())}: a group needs all "
                f"three; {missing} missing. Set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} "
                "together, or start the script with `jddp launch`."
            )
        if self.num_processes is not None:
            assert self.coordinator is not None and self.process_id is not None  # checked above: all three
            if self.num_processes < 1:
                raise ValueError(f"num_processes={self.num_processes} ({ENV_NUM_PROCESSES}) must be at least 1.")
            if not 0 <= self.process_id < self.num_processes:
                raise ValueError(
                    f"process_id={self.process_id} ({ENV_PROCESS_ID}) must be in [0, num_processes="
                    f"{self.num_processes}) ({ENV_NUM_PROCESSES}): process ids run from 0 to {self.num_processes - 1}."
                )
            net.split_address(self.coordinator)

    @property
    def single(self) -> bool:
        """Nothing to join: one process, or no group given and no cluster detected."""
        return self.num_processes == 1 or (self.num_processes is None and not jax_internals.cluster_detected())


def _from_mpi() -> tuple[str, int, int] | None:
    """Under MPI's launcher (``mpiexec`` of MPICH's hydra sets ``PMI_RANK`` and ``PMI_SIZE``), the group is the MPI
    world: ``(coordinator, num_processes, process_id)``, with rank 0 choosing the coordinator's address (loopback when
    every rank runs on its host) and broadcasting it. None when not started by MPI's launcher.

    Raises:
      RuntimeError: started by MPI's launcher as several processes, but mpi4py is not installed: each process would
        otherwise train alone.
    """
    rank, size = _env_int("PMI_RANK"), _env_int("PMI_SIZE")
    if rank is None or size is None or size < 2:
        return None
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise RuntimeError(
            f"This process was started by MPI's launcher as rank {rank} of {size} (PMI_RANK, PMI_SIZE), but mpi4py "
            f"cannot be imported ({error}), so jddp cannot join the others. Install jddp's MPI extra "
            '(`pip install "jddp[mpi]"`), or start the processes with `jddp launch -n N`.'
        ) from None
    _filter_native_stdout()
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    address = None
    if comm.Get_rank() == 0:
        host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        address = f"{host}:{net.free_port(host if host == '127.0.0.1' else '0.0.0.0')}"
    address = comm.bcast(address, root=0)
    return address, comm.Get_size(), comm.Get_rank()


_native_filtered = False  # fd 1 goes through _filter_native_stdout's thread


def _filter_native_stdout() -> None:
    """Drops gloo's chatter from fd 1 in a group joined without ``jddp launch`` (``srun``, ``mpiexec``, ``JDDP_*``
    variables set by hand), where no launcher filters it.

    gloo's C++ prints ``[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is :
    1`` with ``std::cout`` (fd 1), unconditionally (no log level or variable silences it), each time it connects the
    processes of a new set of devices: at the first collective over them, after ``initialize`` returned, so no
    window around ``initialize`` could hold it. fd 1 therefore becomes a pipe that a thread reads line by line for
    the life of the process, writing on every line that is not made of gloo's words alone (``jddp.lines``; its
    "is NOT connected to" warning passes); ``sys.stdout`` keeps the original fd 1, so Python's own output never
    waits on the thread, and both streams write whole lines (``mpiexec`` and ``srun --label`` prefix each write).
    fd 2, where errors go, is untouched."""
    global _native_filtered
    if _native_filtered:
        return
    from jddp import lines  # no JAX

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.flush()
            stream.reconfigure(line_buffering=True)  # pyright: ignore[reportAttributeAccessIssue]
    try:
        original = os.dup(1)
        read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
    except OSError:
        return
    _native_filtered = True
    sys.stdout = os.fdopen(original, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8", errors="replace")

    def forward() -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            for piece in lines.segments(pipe):
                if lines.native_line(piece) is not None:
                    with contextlib.suppress(OSError):
                        os.write(original, piece)

    threading.Thread(target=forward, name="jddp-native-stdout", daemon=True).start()


def _prepare_backend(settings: _Settings) -> None:
    """Before the backend starts: the device count and gloo as the CPU collectives."""
    import jax

    if jax_internals.backend_started():
        raise RuntimeError(
            "jddp.initialize() must run before JAX starts its backend, but the backend is already running "
            f"({jax.device_count()} device(s)). Call it first thing in the script, before creating arrays, "
            "calling jax.devices() or jitting anything."
        )
    if settings.local_devices is not None:
        mesh.simulate_cpu_devices(settings.local_devices)
    if jax.config.jax_platforms in (None, "", "cpu") or settings.local_devices is not None:  # pyright: ignore[reportAttributeAccessIssue]  # jax.config's options are dynamic attributes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def _join(settings: _Settings, shutdown_timeout_s: float) -> str | None:
    """``jax.distributed.initialize`` with the coordinator checked first; returns the coordinator address."""
    import jax

    heartbeat = int(settings.peer_timeout_s + HEARTBEAT_MARGIN_S)
    local_device_ids = None
    if settings.num_processes is None:  # a cluster: what JAX would detect, then joined like a group given in full
        coordinator, num_processes, process_id, local_device_ids = jax_internals.detect_cluster(
            int(settings.init_timeout_s)
        )
        if coordinator is None or num_processes is None or process_id is None:
            jax.distributed.initialize(  # a cluster JAX finds but cannot fully describe ahead: JAX's own way
                initialization_timeout=int(settings.init_timeout_s),
                heartbeat_timeout_seconds=heartbeat,
                shutdown_timeout_seconds=int(shutdown_timeout_s),
            )
            return jax_internals.coordinator_address()
        settings = dataclasses.replace(
            settings, coordinator=coordinator, num_processes=num_processes, process_id=process_id
        )
    coordinator, num_processes, process_id = settings.coordinator, settings.num_processes, settings.process_id
    assert coordinator is not None and num_processes is not None and process_id is not None  # all three, checked
    host, port = net.split_address(coordinator)
    deadline = time.monotonic() + settings.init_timeout_s
    bind = settings.bind_address or coordinator
    if process_id == 0 and envvars.get(ENV_COORDINATOR_HOSTED):
        # jax.distributed.initialize starts a service in process 0 whatever happens; this one listens on a port
        # of its own that no process joins, and the group uses the launcher's.
        bind = "127.0.0.1:0"
        _wait_reachable(host, port, deadline, process_id, num_processes)
    elif process_id == 0:
        # No launcher hosts the service: host it in a child of this process, so that the group outlives process 0
        # long enough to name it when it dies (JAX's own service in process 0 would take every survivor with it).
        net.check_port_free(*net.split_address(bind))
        grace = settings.peer_timeout_s + HEARTBEAT_MARGIN_S
        shutdown = int(shutdown_timeout_s)
        child = coordinator_lib.start_for_parent(bind, num_processes, heartbeat, shutdown, grace)
        atexit.register(coordinator_lib.stop, child)  # runs after the watchdog's exit hook (registered later)
        bind = "127.0.0.1:0"
        _wait_reachable(host, port, deadline, process_id, num_processes)
    else:
        _wait_reachable(host, port, deadline, process_id, num_processes)
    jax.distributed.initialize(
        coordinator,
        num_processes,
        process_id,
        local_device_ids=local_device_ids,
        coordinator_bind_address=bind,
        initialization_timeout=max(1, int(deadline - time.monotonic())),
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=int(shutdown_timeout_s),
    )
    if jax.config.jax_cpu_collectives_implementation == "gloo":  # pyright: ignore[reportAttributeAccessIssue]  # jax.config's options are dynamic attributes
        jax_internals.use_gloo_with_hostname(_own_address_toward(host, port))
    return coordinator


def group() -> ProcessGroup | None:
    """The group joined by ``initialize``, or ``None``."""
    return _group


@progress.collective_call("jddp.barrier", timed=True)
def barrier(name: str, timeout_s: float = 300.0) -> None:
    """Waits until every process has called ``barrier(name)`` (the n-th call matches the n-th).

    A no-op in a single process.

    Raises:
      TypeError: ``name`` is not a non-empty str.
      ValueError: ``name`` holds '/', or ``timeout_s`` is not a positive finite number of seconds.
      TimeoutError: after ``timeout_s``, naming the processes that did not arrive.
    """
    validate.check_str("name", name)
    if "/" in name:
        raise ValueError(
            f"barrier name={name!r} must be a non-empty string without '/' (the name is part of a key of the "
            "coordination service); use another separator, e.g. '-'."
        )
    validate.check_number("timeout_s", timeout_s, unit="seconds")
    client = jax_internals.distributed_client()
    if client is None:
        return
    count = _barrier_counts[name] = _barrier_counts.get(name, 0) + 1
    barrier_id = f"jddp/barrier/{name}/{count}"
    me = _group.process_id if _group else 0
    client.key_value_set(f"{barrier_id}/{me}", "1", allow_overwrite=True)
    try:
        client.wait_at_barrier(barrier_id, int(timeout_s * 1000))
    except Exception as error:  # the coordination service raises a generic runtime error
        arrived = {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get(f"{barrier_id}/")}
        n = _group.num_processes if _group else len(arrived)
        missing = sorted(set(range(n)) - arrived)
        raise TimeoutError(
            f"jddp.barrier({name!r}) call {count} timed out after {timeout_s:g} s on process {me}: "
            f"process(es) {missing} did not arrive ({str(error).splitlines()[0]})"
        ) from None
