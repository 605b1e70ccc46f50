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
  the arguments of the same names. The start-up timeout bounds the join and
  every meeting of the processes before a program's first run
  (``jddp.runtime.first_run``), which keeps gloo's fixed 30-s connection
  window from failing a process merely slower to start than its peers.

A ``JDDP_*`` variable jddp does not declare is named with the closest declared
one, and a scheduler's variables partly set (SLURM without ``srun``'s, Open MPI,
``PMI_*``, ``JAX_COORDINATOR_ADDRESS``...) are named with what is missing before
the process runs alone: a warning on process 0, once (``jddp.runtime.cluster_env``).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import sys
import time

from jddp import envvars, net, validate
from jddp.runtime import (
    cluster_env,
    compile_cache,
    first_run,
    jax_internals,
    join_settings,
    mesh,
    native_stdout,
    process_group,
    progress,
    reach,
    topology,
    watchdog,
)
from jddp.runtime import coordinator as coordinator_lib

# Kept importable here, where the launcher, the CLI and the benchmarks read them.
ENV_COORDINATOR = join_settings.ENV_COORDINATOR
ENV_NUM_PROCESSES = join_settings.ENV_NUM_PROCESSES
ENV_PROCESS_ID = join_settings.ENV_PROCESS_ID
ENV_LOCAL_DEVICES = join_settings.ENV_LOCAL_DEVICES
ENV_PEER_TIMEOUT = join_settings.ENV_PEER_TIMEOUT
ENV_INIT_TIMEOUT = join_settings.ENV_INIT_TIMEOUT
ENV_COORDINATOR_HOSTED = join_settings.ENV_COORDINATOR_HOSTED
ENV_STDOUT_FD = native_stdout.ENV_STDOUT_FD
DEFAULT_PEER_TIMEOUT_S = join_settings.DEFAULT_PEER_TIMEOUT_S
DEFAULT_INIT_TIMEOUT_S = join_settings.DEFAULT_INIT_TIMEOUT_S
ProcessGroup = process_group.ProcessGroup
group = process_group.group
check_joined = process_group.check_joined
topology_line = topology.topology_line
announce_topology = topology.announce_topology

HEARTBEAT_MARGIN_S = 15

_barrier_counts: dict[str, int] = {}


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
) -> process_group.ProcessGroup | None:
    """Joins the process group, or does nothing when this is the only process.

    Args:
      coordinator: ``host:port`` of process 0's coordination service; default
        ``$JDDP_COORDINATOR``.
      num_processes: processes in the group; default ``$JDDP_NUM_PROCESSES``.
      process_id: this process's index; default ``$JDDP_PROCESS_ID``.
      local_devices: simulated CPU devices in this process; default
        ``$JDDP_LOCAL_DEVICES``, else the backend's own count.
      init_timeout_s: the start-up timeout: how long to wait for the
        coordinator and every peer, and for every process to reach each of
        jddp's programs before its first run (``jddp.runtime.first_run``);
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
    join_settings.check_arguments(
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
    launched = native_stdout.own_stdout()
    if process_group.group() is not None:
        return process_group.group()
    settings = join_settings.Settings.resolve(
        coordinator, num_processes, process_id, local_devices, init_timeout_s, peer_timeout_s, bind_address
    )
    stall = progress.Settings.from_env()  # bad JDDP_STALL_* values raise here, before anything starts
    # unknown JDDP_* names, and a scheduler's variables partly set where no group was found (process 0, once)
    cluster_env.warn_environment(alone=settings.single and settings.num_processes is None)
    if settings.num_processes is None and not settings.single:  # a cluster JAX detected: its variables whole
        cluster_env.refuse_partial(os.environ)
    if settings.single:  # nothing to join; simulate_cpu_devices raises if the backend runs with another count
        if settings.local_devices is not None:
            mesh.simulate_cpu_devices(settings.local_devices)
        compile_cache.enable()  # after the checks that refuse: a refused call leaves the cache as it was
        return None
    _prepare_backend(settings)
    # restarts and reruns read their compiled programs back (jddp.runtime.compile_cache); after the backend check,
    # so that a refused call leaves no cache set (tests/test_refusals.py)
    compile_cache.enable()
    coordinator = _join(settings, shutdown_timeout_s)
    first_run.configure(settings.init_timeout_s, from_argument=init_timeout_s is not None)
    if not launched:
        # srun, mpiexec, a group set by hand: no launcher drops gloo's chatter. After _join, so that the coordination
        # service's child (process 0's) keeps the original fd 1.
        native_stdout.filter_native_stdout()
    import jax

    joined = process_group.ProcessGroup(coordinator, jax.process_count(), jax.process_index(), settings.peer_timeout_s)
    process_group.record(joined)
    client = jax_internals.distributed_client()
    progress.PROGRESS.settings = stall
    watchdog.start(client, joined.process_id, joined.num_processes, coordinator, settings.peer_timeout_s)
    if verbose:
        print(
            f"jddp: process {joined.process_id} of {joined.num_processes}: {jax.local_device_count()} local "
            f"{jax.default_backend()} device(s), {jax.device_count()} global, coordinator {coordinator}, "
            f"peer timeout {settings.peer_timeout_s:g} s",
            file=sys.stderr,
            flush=True,
        )
        topology.announce_topology()
    return joined


def _prepare_backend(settings: join_settings.Settings) -> None:
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
    platforms = jax.config.jax_platforms  # pyright: ignore[reportAttributeAccessIssue]  # jax.config's options are dynamic attributes
    if uses_gloo(platforms, settings.local_devices, envvars.get("JDDP_PLATFORM")):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def uses_gloo(jax_platforms: str | None, local_devices: int | None, launched_on: str | None) -> bool:
    """Whether this process's collectives are gloo's: on CPU devices (simulated, or JAX's platform unset or cpu),
    but not under ``jddp launch`` on an accelerator host (``$JDDP_PLATFORM``): gloo carries collectives between CPU
    devices only, and there they are the accelerator's (NCCL, the TPU interconnect).

    >>> uses_gloo(None, None, None), uses_gloo(None, None, "cuda"), uses_gloo(None, 4, "cuda")
    (True, False, True)
    >>> uses_gloo("cuda", None, None)
    False
    """
    if local_devices is not None:  # simulated CPU devices: CPU whatever the host has
        return True
    return jax_platforms in (None, "", "cpu") and launched_on not in ("cuda", "rocm", "tpu")


def _join(settings: join_settings.Settings, shutdown_timeout_s: float) -> str | None:
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
    if process_id == 0 and envvars.get(join_settings.ENV_COORDINATOR_HOSTED):
        # jax.distributed.initialize starts a service in process 0 whatever happens; this one listens on a port
        # of its own that no process joins, and the group uses the launcher's.
        bind = "127.0.0.1:0"
        reach.wait_reachable(host, port, deadline, process_id, num_processes)
    elif process_id == 0:
        # No launcher hosts the service: host it in a child of this process, so that the group outlives process 0
        # long enough to name it when it dies (JAX's own service in process 0 would take every survivor with it).
        net.check_port_free(*net.split_address(bind))
        grace = settings.peer_timeout_s + HEARTBEAT_MARGIN_S
        shutdown = int(shutdown_timeout_s)
        child = coordinator_lib.start_for_parent(bind, num_processes, heartbeat, shutdown, grace)
        atexit.register(coordinator_lib.stop, child)  # runs after the watchdog's exit hook (registered later)
        bind = "127.0.0.1:0"
        reach.wait_reachable(host, port, deadline, process_id, num_processes)
    else:
        reach.wait_reachable(host, port, deadline, process_id, num_processes)
    jax.distributed.initialize(
        **join_settings.join_arguments(
            settings,
            bind=bind,
            local_device_ids=local_device_ids,
            timeout_s=deadline - time.monotonic(),
            heartbeat_s=heartbeat,
            shutdown_s=int(shutdown_timeout_s),
        )
    )
    if jax.config.jax_cpu_collectives_implementation == "gloo":  # pyright: ignore[reportAttributeAccessIssue]  # jax.config's options are dynamic attributes
        jax_internals.use_gloo_with_hostname(_own_address_toward(host, port))
    return coordinator


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
    joined = process_group.group()
    count = _barrier_counts[name] = _barrier_counts.get(name, 0) + 1
    barrier_id = f"jddp/barrier/{name}/{count}"
    me = joined.process_id if joined else 0
    client.key_value_set(f"{barrier_id}/{me}", "1", allow_overwrite=True)
    try:
        client.wait_at_barrier(barrier_id, int(timeout_s * 1000))
    except Exception as error:  # the coordination service raises a generic runtime error
        arrived = {int(key.rsplit("/", 1)[1]) for key, _ in client.key_value_dir_get(f"{barrier_id}/")}
        n = joined.num_processes if joined else len(arrived)
        missing = sorted(set(range(n)) - arrived)
        raise TimeoutError(
            f"jddp.barrier({name!r}) call {count} timed out after {timeout_s:g} s on process {me}: "
            f"process(es) {missing} did not arrive ({str(error).splitlines()[0]})"
        ) from None
