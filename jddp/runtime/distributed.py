"""Joining a group of processes: ``initialize``, ``barrier`` and the peer watchdog.

``initialize()`` is the first line of a training script. What it does depends on
where the script runs:

* alone (``python train.py``): nothing, apart from simulating
  ``JDDP_LOCAL_DEVICES`` CPU devices when that variable is set;
* under ``jddp launch`` (or anything that sets the same variables): it joins the
  group described by ``JDDP_COORDINATOR`` (``host:port``),
  ``JDDP_NUM_PROCESSES``, ``JDDP_PROCESS_ID`` and ``JDDP_LOCAL_DEVICES``;
* under SLURM, Open MPI or Kubernetes (without those variables): it lets
  ``jax.distributed.initialize()`` detect the cluster.

Process 0 runs the coordination service, bound to the coordinator address it is
given (``127.0.0.1:port`` for a local run), never to every interface as JAX's
default ``[::]:port`` does. On CPU the collectives are gloo. Each process prints
one preflight line: its index, the process count, its local and the global
devices, and the coordinator.

Failure detection
-----------------
JAX's own behaviour when a peer dies is a hang in the next collective until the
coordination service's heartbeat timeout (100 s by default), then a C++ abort
with no Python cleanup. jddp adds a watchdog thread to every process of a group.
Every ``peer_timeout_s / 10`` seconds it writes a counter under
``jddp/alive/<process>`` in the coordination service's key-value store and reads
everyone's. It ends the process with ``EXIT_PEER_LOST`` (69) and one line on
stderr naming the lost process, when:

* a peer's counter has not moved for ``peer_timeout_s`` (30 s by default): the
  peer died, was killed, or is frozen;
* a peer reports that it ended with an unhandled exception (jddp marks that in
  ``sys.excepthook``): there is no point waiting for its collectives;
* the coordinator (process 0) no longer answers.

JAX's heartbeat timeout is set ``15 s`` above ``peer_timeout_s``, so the
watchdog speaks first and the C++ abort remains only as a backstop. A watchdog
that was itself starved of the GIL for more than half the timeout judges nobody
on that round, so a long pause in this process is not blamed on its peers. A
peer that ended normally (its script returned) is waited for at exit by a
barrier, which is what lets the last processes finish their work.

Environment variables (``jddp launch`` sets the first five):

* ``JDDP_COORDINATOR``, ``JDDP_NUM_PROCESSES``, ``JDDP_PROCESS_ID``;
* ``JDDP_LOCAL_DEVICES``: simulated CPU devices in this process;
* ``JDDP_PEER_TIMEOUT`` (seconds), ``JDDP_INIT_TIMEOUT`` (seconds): defaults of
  the arguments of the same names.
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import os
import socket
import sys
import threading
import time

from jddp import exitcodes, net

ENV_COORDINATOR = "JDDP_COORDINATOR"
ENV_NUM_PROCESSES = "JDDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDDP_PROCESS_ID"
ENV_LOCAL_DEVICES = "JDDP_LOCAL_DEVICES"
ENV_PEER_TIMEOUT = "JDDP_PEER_TIMEOUT"
ENV_INIT_TIMEOUT = "JDDP_INIT_TIMEOUT"

DEFAULT_PEER_TIMEOUT_S = 30.0
DEFAULT_INIT_TIMEOUT_S = 120.0
HEARTBEAT_MARGIN_S = 15
ALIVE_PREFIX = "jddp/alive/"
DONE = "done"
FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """The group this process joined; ``initialize`` returns it."""

    coordinator: str | None
    num_processes: int
    process_id: int
    peer_timeout_s: float


_group: ProcessGroup | None = None
_watchdog: _Watchdog | None = None
_barrier_counts: dict[str, int] = {}


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} must be an integer.") from None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} must be a number of seconds.") from None


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(
                    errno.EADDRINUSE,
                    f"The coordinator address {host}:{port} is already in use by another program, so process 0 "
                    "cannot start the coordination service there. Pick another port (`jddp launch --coordinator "
                    f"{host}:<port>`), or leave --coordinator out and jddp launch picks a free one.",
                ) from None
            message = f"Process 0 cannot bind the coordinator address {host}:{port}: {e.strerror}."
            raise OSError(e.errno, message) from None


def _wait_reachable(host: str, port: int, deadline: float, process_id: int, num_processes: int) -> None:
    last_error = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last_error = e.strerror or str(e)
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"jddp.initialize: process {process_id} of {num_processes} could not reach the coordinator at "
                f"{host}:{port} within the initialisation timeout ({last_error}). Is process 0 running, and is the "
                f"address right? Raise the timeout with init_timeout_s= or {ENV_INIT_TIMEOUT}."
            )
        time.sleep(0.2)


def _cluster_detected() -> bool:
    from jax._src import clusters

    return any(not env.opt_in_only_method and env.is_env_present() for env in clusters.ClusterEnv._cluster_types)


def _own_address_toward(host: str, port: int) -> str:
    """The local address the kernel would use to reach ``host`` (a UDP connect sends nothing)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]


def _use_gloo_with_hostname(hostname: str) -> None:
    """Registers the CPU backend with gloo collectives advertising ``hostname``.

    gloo advertises the address the machine's hostname resolves to; where that
    is 127.0.0.1 (common on Debian hosts), peers on other hosts cannot connect.
    """
    import functools

    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge
    from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]  # no public API for gloo's hostname

    collectives = _jax.make_gloo_tcp_collectives(
        distributed_client=jax_distributed.global_state.client, hostname=hostname
    )
    xla_bridge.register_backend_factory(
        "cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives), priority=0, fail_quietly=False
    )


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
      TimeoutError: if the coordinator cannot be reached within ``init_timeout_s``.
      OSError: if process 0 finds the coordinator port already in use.
    """
    global _group, _watchdog
    if _group is not None:
        return _group
    import jax
    from jax._src import distributed as jax_distributed
    from jax._src import xla_bridge

    from jddp.runtime import mesh

    coordinator = coordinator if coordinator is not None else os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    local_devices = local_devices if local_devices is not None else _env_int(ENV_LOCAL_DEVICES)
    if init_timeout_s is None:
        init_timeout_s = _env_float(ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT_S)
    if peer_timeout_s is None:
        peer_timeout_s = _env_float(ENV_PEER_TIMEOUT, DEFAULT_PEER_TIMEOUT_S)

    for name, value in (("init_timeout_s", init_timeout_s), ("peer_timeout_s", peer_timeout_s)):
        if not value > 0:
            raise ValueError(f"`{name}` must be a positive number of seconds, got {value!r}.")
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        raise ValueError(
            f"jddp.initialize got {', '.join(f'{k}={v!r}' for k, v in given.items())}: a group needs all three; "
            f"{missing} missing. Set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} together, "
            "or start the script with `jddp launch`."
        )
    if num_processes is not None:
        assert coordinator is not None and process_id is not None  # checked above: a group gets all three
        if num_processes < 1:
            raise ValueError(f"num_processes={num_processes} ({ENV_NUM_PROCESSES}) must be at least 1.")
        if not 0 <= process_id < num_processes:
            raise ValueError(
                f"process_id={process_id} ({ENV_PROCESS_ID}) must be in [0, num_processes={num_processes}) "
                f"({ENV_NUM_PROCESSES}): process ids run from 0 to {num_processes - 1}."
            )
        host, port = net.split_address(coordinator)

    single = num_processes == 1 or (num_processes is None and not _cluster_detected())
    if single:  # nothing to join; simulate_cpu_devices raises if the backend runs with another count
        if local_devices is not None:
            mesh.simulate_cpu_devices(local_devices)
        return None
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "jddp.initialize() must run before JAX starts its backend, but the backend is already running "
            f"({jax.device_count()} device(s)). Call it first thing in the script, before creating arrays, "
            "calling jax.devices() or jitting anything."
        )
    if local_devices is not None:
        mesh.simulate_cpu_devices(local_devices)
    if jax.config.jax_platforms in (None, "", "cpu") or local_devices is not None:  # pyright: ignore[reportAttributeAccessIssue]  # jax.config's options are dynamic attributes
        jax.config.update("jax_cpu_collectives_implementation", "gloo")

    heartbeat = int(peer_timeout_s + HEARTBEAT_MARGIN_S)
    if num_processes is None:
        jax.distributed.initialize(
            initialization_timeout=int(init_timeout_s),
            heartbeat_timeout_seconds=heartbeat,
            shutdown_timeout_seconds=int(shutdown_timeout_s),
        )
        coordinator = jax_distributed.global_state.coordinator_address
    else:
        assert coordinator is not None and process_id is not None  # checked above: a group gets all three
        deadline = time.monotonic() + init_timeout_s
        bind = bind_address or coordinator
        if process_id == 0:
            _check_port_free(*net.split_address(bind))
        else:
            _wait_reachable(host, port, deadline, process_id, num_processes)
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            coordinator_bind_address=bind,
            initialization_timeout=max(1, int(deadline - time.monotonic())),
            heartbeat_timeout_seconds=heartbeat,
            shutdown_timeout_seconds=int(shutdown_timeout_s),
        )
        if jax.config.jax_cpu_collectives_implementation == "gloo":  # pyright: ignore[reportAttributeAccessIssue]  # jax.config's options are dynamic attributes
            _use_gloo_with_hostname(_own_address_toward(host, port))

    _group = ProcessGroup(coordinator, jax.process_count(), jax.process_index(), peer_timeout_s)
    _watchdog = _Watchdog(jax_distributed.global_state.client, _group, shutdown_timeout_s)
    _watchdog.start()
    _install_exit_hooks()
    if verbose:
        print(
            f"jddp: process {_group.process_id} of {_group.num_processes}: {jax.local_device_count()} local "
            f"{jax.default_backend()} device(s), {jax.device_count()} global, coordinator {coordinator}, "
            f"peer timeout {peer_timeout_s:g} s",
            file=sys.stderr,
            flush=True,
        )
    return _group


def group() -> ProcessGroup | None:
    """The group joined by ``initialize``, or ``None``."""
    return _group


def _client():
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def barrier(name: str, timeout_s: float = 300.0) -> None:
    """Waits until every process has called ``barrier(name)`` (the n-th call matches the n-th).

    A no-op in a single process.

    Raises:
      TimeoutError: after ``timeout_s``, naming the processes that did not arrive.
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"barrier name={name!r} must be a non-empty string without '/'.")
    client = _client()
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


class _Watchdog(threading.Thread):
    """Ends this process when a peer is lost; see the module docstring."""

    def __init__(self, client, group: ProcessGroup, shutdown_timeout_s: float):
        super().__init__(name="jddp-peer-watchdog", daemon=True)
        self.client = client
        self.group = group
        self.shutdown_timeout_s = shutdown_timeout_s
        self.interval = max(0.05, group.peer_timeout_s / 10)
        self.state: str | None = None  # None while running, then DONE or FAILED
        self.stopped = threading.Event()
        self.key = f"{ALIVE_PREFIX}{group.process_id}"

    def run(self) -> None:
        peers = [p for p in range(self.group.num_processes) if p != self.group.process_id]
        last_value: dict[int, str | None] = dict.fromkeys(peers)
        last_change = dict.fromkeys(peers, time.monotonic())
        last_round = time.monotonic()
        counter = 0
        while not self.stopped.wait(self.interval):
            counter += 1
            try:
                self.client.key_value_set(self.key, self.state or str(counter), allow_overwrite=True)
                entries = self.client.key_value_dir_get(ALIVE_PREFIX)
            except Exception as error:
                if self.stopped.is_set() or _client() is None:  # stopped, or jax.distributed.shutdown() was called
                    return
                self._fail(
                    f"lost the coordinator (process 0 at {self.group.coordinator}): "
                    f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
                )
            now = time.monotonic()
            starved = now - last_round > self.group.peer_timeout_s / 2
            last_round = now
            values = {int(k.rsplit("/", 1)[1]): v for k, v in entries}
            for p in peers:
                value = values.get(p)
                if value == FAILED:
                    self._fail(f"process {p} ended with an unhandled exception (see its output)")
                if value != last_value[p] or starved or value == DONE:
                    last_value[p], last_change[p] = value, now
            silent = [p for p in peers if now - last_change[p] > self.group.peer_timeout_s]
            if silent:
                self._fail(
                    f"lost process(es) {silent}: no sign of life for more than {self.group.peer_timeout_s:g} s "
                    "(killed, crashed or frozen)"
                )

    def _fail(self, reason: str) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        message = (
            f"jddp: process {self.group.process_id} of {self.group.num_processes} {reason}; "
            f"exiting with code {exitcodes.EXIT_PEER_LOST}.\n"
        )
        os.write(2, message.encode())
        os._exit(exitcodes.EXIT_PEER_LOST)

    def mark(self, state: str) -> None:
        self.state = state
        try:
            self.client.key_value_set(self.key, state, allow_overwrite=True)
        except Exception:
            pass


def _install_exit_hooks() -> None:
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        previous_hook(kind, value, traceback)
        watchdog = _watchdog
        if watchdog is None or issubclass(kind, KeyboardInterrupt):
            return
        if _is_collective_failure(value):
            # gloo noticed a closed connection before the watchdog noticed the silence; give the watchdog time
            # to name the lost process (it ends this process), and only then blame this process.
            print(
                f"jddp: a collective failed on process {watchdog.group.process_id}; waiting up to "
                f"{watchdog.group.peer_timeout_s:g} s to find out which peer is lost",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(watchdog.group.peer_timeout_s + 3 * watchdog.interval)
        watchdog.mark(FAILED)

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def _is_collective_failure(error: BaseException) -> bool:
    # XLA surfaces a broken gloo connection as JaxRuntimeError or, from some call sites, ValueError.
    text = str(error)
    return any(marker in text for marker in ("Gloo", "Connection closed by peer", "Connection reset by peer"))


def _at_exit() -> None:
    """Finished normally: wait for the others (the watchdog still guards us), then let JAX shut down."""
    watchdog = _watchdog
    if watchdog is None or not watchdog.is_alive():
        return
    if watchdog.state == FAILED:
        # Peers stop on the mark; waiting for them at a barrier would only delay the exit.
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)
    watchdog.mark(DONE)
    # Wait for every peer to finish, however long its remaining work takes: the watchdog (still running) ends
    # this process if a peer dies or fails meanwhile. Only then does JAX's own time-limited shutdown barrier run.
    peers = set(range(watchdog.group.num_processes)) - {watchdog.group.process_id}
    while True:
        try:
            values = {int(k.rsplit("/", 1)[1]): v for k, v in watchdog.client.key_value_dir_get(ALIVE_PREFIX)}
        except Exception:
            break  # the coordinator is gone: nothing left to wait for
        if all(values.get(p) in (DONE, FAILED) for p in peers):
            break
        time.sleep(watchdog.interval)
    watchdog.stopped.set()
    watchdog.join(timeout=5)
