"""What does each of jddp's control-plane exchanges cost the coordination service at N simulated processes?

The control plane at N simulated processes: what each of jddp's exchanges costs the coordination service.

    python -m benchmarks control_plane [--n 2,8,32,128] [--workers 4] [--reps 10] [--peer-timeout 5]

For each N, the real coordination service runs in a process of its own, as ``jddp launch`` runs it
(``python -m jddp.runtime.coordinator``), and N simulated processes talk to it: each one is a JAX distributed
runtime client of its own (``_jax.get_distributed_runtime_client``, the client ``jax.distributed.initialize``
makes, ``connect()``ed with its task id), hosted by ``--workers`` OS processes (N / workers clients each, one
thread per client). No JAX computation, no devices. Each simulated process makes exactly the calls a jddp
process makes, through a proxy that counts every call and the bytes of its keys and values:

* ``heartbeat``: one watchdog round (``jddp/runtime/watchdog.py``, ``Watchdog._watch``): ``key_value_set`` of
  its value under ``jddp/alive/<p>`` (the value built by ``watchdog._value`` and ``progress.publish``, as
  there, of a process at step ``--at-step`` of a training loop: ``mid_training``); then the aggregator (process
  0) reads every heartbeat (``key_value_dir_get`` of ``ALIVE_PREFIX``, parsed by ``watchdog._entries``) and sets
  its summary (``watchdog.Summary``), and every other process reads the summary (``key_value_try_get``). Every
  process at once;
* ``heartbeat_all_read``: the round before the aggregator (jddp until 26 Nov 2026): every process sets its value
  and reads every heartbeat, N^2 values a round; kept to measure before and after side by side;
* ``barrier``: ``jddp.barrier``'s calls (``jddp/runtime/distributed.py``, ``barrier``): ``key_value_set`` of
  ``jddp/barrier/<name>/<count>/<p>``, ``wait_at_barrier``;
* ``all_gather``: ``jddp.host_all_gather``'s calls (``jddp/runtime/host.py``, ``_exchange``) of a small dict:
  ``key_value_set_bytes`` of the payload ``host._payload`` makes, ``wait_at_barrier``,
  ``key_value_dir_get_bytes``, ``key_value_delete`` of the previous call's key;
* ``restart``: the whole group's control plane restarted, as ``jddp launch``'s next attempt does it: every
  client leaves (JAX's shutdown), the service ends, a new one starts on a new port and N new clients join it
  (``Group.restart``: the seconds of each part; ``rejoin s`` in the table is the join alone);
* ``detection``: jddp's own ``Watchdog`` thread per simulated process (driven with the simulated client, its
  exit replaced by a record of when and what it found), at ``--peer-timeout``; after ``--warmup`` s one
  simulated process stops its watchdog (no more heartbeats: a frozen or killed process), and the time until each
  survivor names it is taken. The steady state before the stop gives the service's load at the watchdog's own
  pace (rounds every ``peer_timeout / 10`` s, at most 1 s). ``--observers K``: only processes below K run
  jddp's Watchdog (and are timed); the others make its two calls at its pace without parsing the N values
  (``LightRound``): the same load at the service, far less of the simulator's own CPU.

``--real``: the check of the simulator against real processes, for each N: ``jddp launch -n N`` of processes
that import JAX, join the group with ``jddp.initialize`` and stay idle (their watchdogs running), the
coordination service's CPU per second over ``--window`` s and the time to the last join; then the simulator's
steady-state figure at the same N (``detection``'s, heartbeat values of a process before any step, as theirs).

The preemption and checkpoint agreements (``jddp/checkpoint/preemption.py``, ``checkpointer.py``) are
``multihost_utils.process_allgather``: a device collective over gloo, not a call to the coordination service, so
it is not simulated here (its cost is gloo's, which needs devices).

Per round: requests and bytes (keys and values sent and received; not gRPC's framing, nor the clients' own
heartbeats to the service), the service's CPU time (``/proc/<pid>/stat``; in the table, less its rate with
every client connected and idle, measured first for ``idle_s``: the clients' own heartbeats), and the
latency: ``p50`` is the median a process sees from its first call to its last; for the barrier and the
all-gather ``group`` is from the last process's arrival to the last one's return; for the heartbeat round, from
the first process's start to the last one's end. Each latency is the median of ``--reps`` repetitions, the
counts and the CPU their mean. The load average is printed with each row. The last table gives each cost's
slope of log(cost) on log(N) (least squares): 1 is linear, 2 quadratic. ``--ops`` picks the exchanges
(``none``: detection alone).

What bounds the simulator: all N clients share this machine's cores (each client is about three C++ threads
and one Python thread), so past a few hundred clients on 2 cores the latencies measure the clients' own CPU
(N^2 values turned into Python objects per round) more than the service, whose CPU time stays the figure to
read; the watchdogs' rounds fall behind their interval, and a round later than half the peer timeout judges
nobody (the watchdog's ``starved`` rule), so detection needs ``--observers`` and a longer ``--peer-timeout``
there. JAX's own client heartbeat (``--service-heartbeat``; by default the peer timeout + 15 s, as jddp sets it)
can be missed too, and then the service aborts every client (measured on a 2-core VM at N = 1024, 26 Nov 2026).
The clients of one worker share one connection to the service (gRPC shares a channel's connection between
channels to one address in a process): the service serves ``--workers`` connections, where N real processes make
N, and its CPU per request is lower than theirs (``service_sockets``; ``benchmarks/control_plane_real.py``
measures both: at N = 32 the real service's CPU per round or call was 1.4 to 1.7 times this simulator's with 4
workers, and within a quarter of it with 32 workers, one connection each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from jddp import validate

OPS = ("heartbeat", "heartbeat_all_read", "barrier", "all_gather")
AT_STEP = 10_000  # the simulated processes' progress (``mid_training``): the heartbeat values of a run at this step
SMALL_VALUE = {"position": 1234, "batches": 56}  # the loader's agreement sends about this (jddp/data/loader.py)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def size(value: Any) -> int:
    """The bytes of a key-value call's arguments or result: strings (UTF-8) and bytes by length, numbers 8."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes | bytearray):
        return len(value)
    if isinstance(value, bool | int | float):
        return 8
    if isinstance(value, list | tuple):
        return sum(size(v) for v in value)
    raise TypeError(f"size: no size for a value of type {type(value).__name__}")


class Counted:
    """A coordination-service client that counts each call (``requests``, by method) and its bytes (``sent``:
    keys and values given, ``received``: what came back). One per simulated process: no locking."""

    def __init__(self, client: Any):
        self.client = client
        self.requests: dict[str, int] = {}
        self.sent = 0
        self.received = 0
        self.values_received = 0  # key-value pairs the reads returned

    def __getattr__(self, name: str):
        fn = getattr(self.client, name)

        def call(*args, **kwargs):
            self.requests[name] = self.requests.get(name, 0) + 1
            self.sent += size(list(args)) + size(list(kwargs.values()))
            result = fn(*args, **kwargs)
            self.received += size(result)
            if name.startswith("key_value_dir_get"):
                self.values_received += len(result)
            elif name.startswith(("key_value_try_get", "blocking_key_value_get")):
                self.values_received += 1
            return result

        call.__name__ = name
        return call

    def take(self) -> dict[str, Any]:
        """The counts so far, then zero."""
        out = {
            "requests": sum(self.requests.values()),
            "by_call": dict(self.requests),
            "sent": self.sent,
            "received": self.received,
            "values": self.values_received,
        }
        self.requests, self.sent, self.received, self.values_received = {}, 0, 0, 0
        return out


def add_counts(counts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {"requests": 0, "by_call": {}, "sent": 0, "received": 0, "values": 0}
    for c in counts:
        for key in ("requests", "sent", "received", "values"):
            total[key] += c[key]
        for name, k in c["by_call"].items():
            total["by_call"][name] = total["by_call"].get(name, 0) + k
    return total


def mid_training(steps: int) -> None:
    """This OS process's progress (``jddp.runtime.progress``) as in a training loop after ``steps`` steps of
    ``DataParallel.step`` and ``Checkpointer.maybe_save``, through progress's own calls: the heartbeat values then
    carry a run's step, ticks, phase and its last collective calls' names (about 200 bytes, 25 before any)."""
    from jddp.runtime import progress

    for step in range(steps):
        with progress.collective_call("DataParallel.step", eager=False), progress.phase("step"):
            progress.heartbeat(step + 1)
        with progress.collective_call("Checkpointer.maybe_save", eager=False):
            pass


class SimProcess:
    """One simulated jddp process: its task id, its counted client, and jddp's calls for each exchange."""

    def __init__(self, process_id: int, num_processes: int, client: Any):
        self.process_id, self.num_processes = process_id, num_processes
        self.client = Counted(client)
        self.counter = 0
        self.barrier_count = 0
        self.host_calls = 0
        self.last_entries: dict[int, str] = {}  # the heartbeat values of the last round, by process (aggregator)
        self.last_summary: Any = None  # the aggregator's summary as the last round read it (every other process)
        self.last_gathered: list[Any] = []  # the values of the last all-gather, in process order

    def heartbeat(self) -> None:
        """One watchdog round's calls (jddp/runtime/watchdog.py, Watchdog._watch): the value and its set; then the
        aggregator (process 0) reads every heartbeat and publishes its summary (``Watchdog._publish_summary``), and
        every other process reads that summary."""
        from jddp.runtime import progress, watchdog

        self.counter += 1
        value = watchdog._value(progress.publish(self.counter, False))
        self.client.key_value_set(f"{watchdog.ALIVE_PREFIX}{self.process_id}", value, allow_overwrite=True)
        if self.process_id == watchdog.AGGREGATOR:
            values, _, _ = watchdog._entries(self.client.key_value_dir_get(watchdog.ALIVE_PREFIX))
            self.last_entries = values
            summary = watchdog.Summary(self.counter, {}, [], None, False)
            self.client.key_value_set(watchdog.SUMMARY_KEY, summary.text(), allow_overwrite=True)
        else:
            self.last_summary = watchdog._parse_summary(watchdog._try_get(self.client, watchdog.SUMMARY_KEY))

    def heartbeat_all_read(self) -> None:
        """The watchdog round before its aggregator (jddp before 26 Nov 2026): every process set its value and read
        every other's (``key_value_dir_get`` of ``ALIVE_PREFIX``), N^2 values at the service a round."""
        from jddp.runtime import progress, watchdog

        self.counter += 1
        value = watchdog._value(progress.publish(self.counter, False))
        self.client.key_value_set(f"{watchdog.ALIVE_PREFIX}{self.process_id}", value, allow_overwrite=True)
        values, _, _ = watchdog._entries(self.client.key_value_dir_get(watchdog.ALIVE_PREFIX))
        self.last_entries = values

    def announce(self) -> None:
        """What a collective call does first (``progress.collective_call``): the watchdog publishes this process's
        heartbeat value at once (``Watchdog.announce``)."""
        from jddp.runtime import progress, watchdog

        value = watchdog._value(progress.publish(self.counter, False))
        self.client.key_value_set(f"{watchdog.ALIVE_PREFIX}{self.process_id}", value, allow_overwrite=True)

    def barrier(self, timeout_s: float = 300.0) -> None:
        """jddp.barrier's calls (jddp/runtime/distributed.py, barrier), its announce first."""
        self.announce()
        self.barrier_count += 1
        barrier_id = f"jddp/barrier/sim/{self.barrier_count}"
        self.client.key_value_set(f"{barrier_id}/{self.process_id}", "1", allow_overwrite=True)
        self.client.wait_at_barrier(barrier_id, int(timeout_s * 1000))

    def all_gather(self, value: Any = None, timeout_s: float = 300.0) -> list[Any]:
        """jddp.host_all_gather's calls (jddp/runtime/host.py, _exchange), with its payload, its announce first."""
        from jddp.runtime import host

        self.announce()
        self.host_calls += 1
        call = f"{host._PREFIX}/{self.host_calls}"
        data = host._payload("host_all_gather", SMALL_VALUE if value is None else value, True)
        self.client.key_value_set_bytes(f"{call}/{self.process_id}", data)
        self.client.wait_at_barrier(call, int(timeout_s * 1000))
        entries = {int(key.rsplit("/", 1)[1]): d for key, d in self.client.key_value_dir_get_bytes(f"{call}/")}
        if self.host_calls > 1:
            self.client.key_value_delete(f"{host._PREFIX}/{self.host_calls - 1}/{self.process_id}")
        self.last_gathered = [pickle.loads(entries[i])[1] for i in range(self.num_processes)]
        return self.last_gathered


def make_watchdog_class():
    """jddp's Watchdog, its exit replaced by a record (time, reason): N of them share one OS process here."""
    from jddp.runtime import watchdog

    class SimWatchdog(watchdog.Watchdog):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.found: tuple[float, str] | None = None

        def _fail(self, reason: str, *, mark: str = watchdog.LOST, **kwargs) -> None:
            # jddp's: a note, a line on stderr, the mark set for the peers (kept here), process 0's linger, os._exit
            self.found = (time.monotonic(), reason)
            with contextlib.suppress(Exception):
                self.call(
                    self.client.key_value_set, self.key, watchdog._value(mark), allow_overwrite=True, timeout_s=2.0
                )
            self.stopped.set()

    return SimWatchdog


class LightRound(threading.Thread):
    """A simulated process other than the aggregator that makes the watchdog's calls at its pace
    (jddp/runtime/watchdog.py, ``Watchdog._watch``: ``key_value_set`` of its value, ``key_value_try_get`` of the
    aggregator's summary) and judges nothing: the same load at the service, less of the simulator's own CPU
    (``--observers``)."""

    def __init__(self, sim: SimProcess, peer_timeout_s: float):
        from jddp.runtime import watchdog

        super().__init__(name=f"sim-round-{sim.process_id}", daemon=True)
        self.client, self.process_id = sim.client, sim.process_id
        self.interval = max(0.05, min(peer_timeout_s / 10, watchdog.MAX_ROUND_S))  # as Watchdog.interval
        self.key = f"{watchdog.ALIVE_PREFIX}{sim.process_id}"
        self.stopped = threading.Event()
        self.found = None
        self.counter = 0

    def run(self) -> None:
        from jddp.runtime import progress, watchdog

        while not self.stopped.wait(self.interval):
            self.counter += 1
            with contextlib.suppress(Exception):
                value = watchdog._value(progress.publish(self.counter, False))
                self.client.key_value_set(self.key, value, allow_overwrite=True)
                watchdog._try_get(self.client, watchdog.SUMMARY_KEY)


class Worker:
    """The simulated processes one OS process hosts, one thread each, run together on each command."""

    def __init__(self, address: str, ids: Sequence[int], num_processes: int, heartbeat_s: int, at_step: int = 0):
        if at_step:
            mid_training(at_step)
        self.address, self.num_processes, self.ids, self.heartbeat_s = address, num_processes, ids, heartbeat_s
        self._make_clients(address)
        self.watchdogs: list[Any] = []

    def _make_clients(self, address: str) -> None:
        from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]

        self.clients = [
            _jax.get_distributed_runtime_client(
                address, i, init_timeout=600, heartbeat_timeout=self.heartbeat_s, use_compression=True
            )
            for i in self.ids
        ]
        self.sims = [SimProcess(i, self.num_processes, c) for i, c in zip(self.ids, self.clients, strict=True)]

    def _together(self, fn) -> list[Any]:
        """``fn(sim)`` on every simulated process at once (a thread each); each one's (start, end, result)."""
        out: list[Any] = [None] * len(self.sims)
        go = threading.Event()

        def run(k: int, sim: SimProcess) -> None:
            go.wait()
            start = time.monotonic()
            try:
                result = fn(sim)
            except Exception as error:  # reported, not raised in a thread
                result = error
            out[k] = (start, time.monotonic(), result)

        threads = [threading.Thread(target=run, args=(k, s), daemon=True) for k, s in enumerate(self.sims)]
        for t in threads:
            t.start()
        go.set()
        for t in threads:
            t.join()
        errors = [r for _, _, r in out if isinstance(r, Exception)]
        if errors:
            raise RuntimeError(f"{len(errors)} simulated process(es) failed: {errors[0]}")
        return out

    def connect(self) -> dict[str, Any]:
        times = self._together(lambda sim: sim.client.connect())
        return {"times": [(s, e) for s, e, _ in times]}

    def op(self, name: str) -> dict[str, Any]:
        times = self._together(lambda sim: getattr(sim, name)())
        return {"times": [(s, e) for s, e, _ in times], "counts": add_counts([s.client.take() for s in self.sims])}

    def start_watchdogs(self, peer_timeout_s: float, observers: int | None = None) -> dict[str, Any]:
        """jddp's Watchdog for every simulated process, or only for those below ``observers`` (the others:
        ``LightRound``)."""
        from jddp.runtime import watchdog

        watchdog._arm_stack_dump = lambda timeout_s: None  # one faulthandler per OS process: not N of them
        cls = make_watchdog_class()
        for s in self.sims:
            s.client.take()
        self.watchdogs = [
            cls(s.client, s.process_id, self.num_processes, None, peer_timeout_s)
            if observers is None or s.process_id < observers
            else LightRound(s, peer_timeout_s)
            for s in self.sims
        ]
        for w in self.watchdogs:
            w.start()
        return {}

    def read(self, prefix: str) -> dict[str, Any]:
        """The store's entries under ``prefix``, read by the first client past the counting (for checks)."""
        return {"entries": list(self.clients[0].key_value_dir_get_bytes(prefix))}

    def gathered(self) -> dict[str, Any]:
        return {"values": self.sims[0].last_gathered}

    def counts(self) -> dict[str, Any]:
        return {"counts": add_counts([s.client.take() for s in self.sims])}

    def stop_one(self, process_id: int) -> dict[str, Any]:
        for w in self.watchdogs:
            if w.process_id == process_id:
                w.stopped.set()
                return {"stopped_at": time.monotonic()}
        raise ValueError(f"stop_one: process_id={process_id} is not hosted by this worker")

    def found(self) -> dict[str, Any]:
        return {"found": {w.process_id: w.found for w in self.watchdogs if not isinstance(w, LightRound)}}

    def stop_watchdogs(self) -> dict[str, Any]:
        for w in self.watchdogs:
            w.stopped.set()
        for w in self.watchdogs:
            w.join(timeout=10)
        return {}

    def shutdown(self) -> dict[str, Any]:
        self._together(lambda sim: sim.client.shutdown())
        return {}

    def disconnect(self) -> dict[str, Any]:
        """Every client leaves the group (``shutdown``: JAX's shutdown barrier), the worker stays (``rejoin``)."""
        times = self._together(lambda sim: sim.client.shutdown())
        return {"times": [(s, e) for s, e, _ in times]}

    def rejoin(self, address: str) -> dict[str, Any]:
        """New clients for the same processes, joined to the service at ``address`` (a restarted group's)."""
        start = time.monotonic()
        self._make_clients(address)
        made = time.monotonic()
        times = self._together(lambda sim: sim.client.connect())
        return {"made_s": made - start, "times": [(s, e) for s, e, _ in times]}


def serve(connection, address: str, ids: Sequence[int], num_processes: int, heartbeat_s: int, at_step: int) -> None:
    """A worker's loop: a command (a method of ``Worker`` and its arguments) in, its result out."""
    try:
        worker = Worker(address, ids, num_processes, heartbeat_s, at_step)
    except Exception as error:
        connection.send({"error": repr(error)})
        return
    connection.send({})
    while True:
        name, args = connection.recv()
        try:
            result = getattr(worker, name)(*args)
        except Exception as error:
            result = {"error": f"{name}: {error!r}"}
        connection.send(result)
        if name == "shutdown":
            return


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def sockets(pid: int) -> int:
    """The sockets a process holds open (its listening one and one per connection; /proc/<pid>/fd)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def loadavg() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def slope(ns: Sequence[float], costs: Sequence[float]) -> float:
    """The least-squares slope of log(cost) on log(N) (1: linear, 2: quadratic); nan with fewer than two
    positive costs."""
    points = [(math.log(n), math.log(c)) for n, c in zip(ns, costs, strict=True) if c > 0]
    if len(points) < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return float("nan")
    return sum((x - mx) * (y - my) for x, y in points) / sxx


class Group:
    """The service and the workers for one N."""

    def __init__(
        self,
        num_processes: int,
        workers: int,
        peer_timeout_s: float,
        inprocess: bool = False,
        service_heartbeat_s: int | None = None,
        at_step: int = AT_STEP,
    ):
        """``inprocess``: the workers are threads of this process (for tests; pass ``at_step=0`` there, since they
        would share this process's progress)."""
        from jddp.runtime import distributed

        self.n = num_processes
        # JAX's own heartbeat timeout (each client to the service): as jddp.initialize sets it, unless given
        heartbeat_s = service_heartbeat_s or int(peer_timeout_s + distributed.HEARTBEAT_MARGIN_S)
        self.heartbeat_s = heartbeat_s
        self.start_service()
        workers = min(workers, num_processes)
        self.ids = [list(range(w, num_processes, workers)) for w in range(workers)]
        self.connections = []
        self.procs: list[Any] = []
        context = multiprocessing.get_context("spawn")
        for ids in self.ids:
            mine, theirs = multiprocessing.Pipe()
            target_args = (theirs, self.address, ids, num_processes, heartbeat_s, at_step)
            if inprocess:
                proc: Any = threading.Thread(target=serve, args=target_args, daemon=True)
            else:
                proc = context.Process(target=serve, args=target_args, daemon=True)
            proc.start()
            self.connections.append(mine)
            self.procs.append(proc)
        for c in self.connections:
            answer = c.recv()
            if "error" in answer:
                self.close()
                raise RuntimeError(f"a worker did not start: {answer['error']}")

    def start_service(self) -> None:
        """The coordination service on a new port, as ``jddp launch`` starts it (``python -m
        jddp.runtime.coordinator``); returns once it listens."""
        from jddp.runtime import coordinator

        self.address = f"127.0.0.1:{free_port()}"
        argv = [self.address, str(self.n), str(self.heartbeat_s), "5"]  # jddp.runtime.coordinator's USAGE
        self.service = subprocess.Popen(
            [sys.executable, "-u", "-m", "jddp.runtime.coordinator", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert self.service.stdout is not None
        line = self.service.stdout.readline().decode()
        if not line.startswith(coordinator.READY):
            self.service.kill()
            self.service.wait()
            self.service.stdout.close()
            raise RuntimeError(f"the coordination service did not start: {line!r}")

    def stop_service(self) -> None:
        if self.service.stdout is not None:
            self.service.stdout.close()
        if self.service.poll() is None:
            self.service.terminate()
            try:
                self.service.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.service.kill()

    def restart(self) -> dict[str, Any]:
        """The whole group's control plane restarted: every client leaves, the service ends, a new one starts on a
        new port (``jddp launch``'s next attempt) and N new clients join it. Seconds of each part."""
        t0 = time.monotonic()
        self.all("disconnect")
        t1 = time.monotonic()
        self.stop_service()
        t2 = time.monotonic()
        self.start_service()
        t3 = time.monotonic()
        answers = self.all("rejoin", self.address)
        t4 = time.monotonic()
        spans = [t for a in answers for t in a["times"]]
        return {
            "restart_s": t4 - t0,
            "leave_s": t1 - t0,
            "service_stop_s": t2 - t1,
            "service_start_s": t3 - t2,
            "rejoin_s": t4 - t3,
            "join_s": max(e for _, e in spans) - min(s for s, _ in spans),
            "clients_made_s": max(a["made_s"] for a in answers),
        }

    def all(self, name: str, *args) -> list[dict[str, Any]]:
        """Runs ``Worker.<name>(*args)`` on every worker at once; their answers."""
        for c in self.connections:
            c.send((name, args))
        answers = [c.recv() for c in self.connections]
        for a in answers:
            if "error" in a:
                raise RuntimeError(f"worker: {a['error']}")
        return answers

    def one(self, worker: int, name: str, *args) -> dict[str, Any]:
        self.connections[worker].send((name, args))
        answer = self.connections[worker].recv()
        if "error" in answer:
            raise RuntimeError(f"worker {worker}: {answer['error']}")
        return answer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.all("shutdown")
        for p in self.procs:
            if isinstance(p, threading.Thread):
                p.join(timeout=10)
            else:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        self.stop_service()


def measure(
    num_processes: int,
    *,
    workers: int = 4,
    reps: int = 10,
    peer_timeout_s: float = 5.0,
    warmup_s: float = 3.0,
    detection: bool = True,
    observers: int | None = None,
    inprocess: bool = False,
    service_heartbeat_s: int | None = None,
    ops: Sequence[str] = OPS,
    at_step: int = AT_STEP,
    idle_s: float = 2.0,
    restart: bool = True,
) -> dict[str, Any]:
    """Every figure at one N (see the module docstring); the raw numbers as a dict."""
    validate.check_int("num_processes", num_processes, minimum=2)
    validate.check_int("workers", workers, minimum=1)
    validate.check_int("reps", reps, minimum=1)
    validate.check_number("peer_timeout_s", peer_timeout_s, unit="seconds")
    validate.check_number("warmup_s", warmup_s, unit="seconds")
    if any(op not in OPS for op in ops):
        raise ValueError(f"ops={list(ops)!r}: each must be one of {OPS}")
    result: dict[str, Any] = {"n": num_processes, "workers": workers, "load_start": loadavg()}
    t0 = time.monotonic()
    validate.check_int("at_step", at_step, minimum=0)
    validate.check_number("idle_s", idle_s, unit="seconds")
    group = Group(
        num_processes,
        workers,
        peer_timeout_s,
        inprocess=inprocess,
        service_heartbeat_s=service_heartbeat_s,
        at_step=at_step,
    )
    try:
        spans = [t for a in group.all("connect") for t in a["times"]]
        result["start_s"] = time.monotonic() - t0  # the service and the workers started, the clients made
        result["join_s"] = max(e for _, e in spans) - min(s for s, _ in spans)  # connect(): first call to last return
        result["service_sockets"] = sockets(group.service.pid)
        pid = group.service.pid
        # The service's CPU with every client connected and idle (their own heartbeats to it): taken off below
        cpu0, w0 = cpu_s(pid), time.monotonic()
        time.sleep(idle_s)
        idle = (cpu_s(pid) - cpu0) / (time.monotonic() - w0)
        result["service_idle_cpu_per_s"] = idle
        for op in ops:
            group.all("op", op)  # a warm-up repetition (first keys, the barrier's first use)
            cpu0, w0 = cpu_s(pid), time.monotonic()
            latencies, groups, counts = [], [], []
            for _ in range(reps):
                answers = group.all("op", op)
                times = [t for a in answers for t in a["times"]]
                counts.append(add_counts([a["counts"] for a in answers]))
                latencies.append(statistics.median(e - s for s, e in times))
                first = min(s for s, _ in times) if op.startswith("heartbeat") else max(s for s, _ in times)
                groups.append(max(e for _, e in times) - first)
            total = add_counts(counts)
            result[op] = {
                "p50_ms": 1e3 * statistics.median(latencies),
                "group_ms": 1e3 * statistics.median(groups),
                "service_cpu_ms": 1e3 * (cpu_s(pid) - cpu0) / reps,
                "service_cpu_net_ms": 1e3 * (cpu_s(pid) - cpu0 - idle * (time.monotonic() - w0)) / reps,
                "requests": total["requests"] / reps,
                "bytes": (total["sent"] + total["received"]) / reps,
                "values": total["values"] / reps,
                "by_call": {k: v / reps for k, v in total["by_call"].items()},
            }
            print(f"N={num_processes} {op}: {json.dumps(result[op])}", file=sys.stderr, flush=True)
        if restart:
            try:
                result["restart"] = group.restart()
            except Exception as error:  # the figures above stay; the detection below needs the group: none
                result["restart_error"] = repr(error)
                detection = False
            print(f"N={num_processes} restart: {json.dumps(result['restart'])}", file=sys.stderr, flush=True)
        if detection:
            if observers is not None and observers >= num_processes - 1:
                observers = None  # every survivor observes
            result["detection"] = detect(group, peer_timeout_s, warmup_s, observers)
    finally:
        group.close()
    result["load_end"] = loadavg()
    return result


def detect(
    group: Group, peer_timeout_s: float, warmup_s: float, observers: int | None = None, victim: int | None = None
) -> dict[str, Any]:
    """jddp's watchdogs at their own pace: the steady state for ``warmup_s``, then ``victim`` (the last process by
    default; 0 is the aggregator) stops. With ``observers``, only the processes below it run jddp's Watchdog (and
    are timed); the others make its calls (``LightRound``)."""
    if observers is not None:
        validate.check_int("observers", observers, minimum=1)
        if observers >= group.n:
            raise ValueError(f"detect: observers={observers} must be below N={group.n} (the last one is stopped)")
    victim = group.n - 1 if victim is None else victim
    if not 0 <= victim < group.n:
        raise ValueError(f"detect: victim={victim} must be a process of the group (0 to {group.n - 1})")
    pid = group.service.pid
    group.all("start_watchdogs", peer_timeout_s, observers)
    time.sleep(min(1.0, warmup_s))  # the first rounds
    group.all("counts")
    cpu0, w0 = cpu_s(pid), time.monotonic()
    time.sleep(warmup_s)
    counts = add_counts([a["counts"] for a in group.all("counts")])
    elapsed, cpu = time.monotonic() - w0, cpu_s(pid) - cpu0
    host = next(k for k, ids in enumerate(group.ids) if victim in ids)
    stopped_at = group.one(host, "stop_one", victim)["stopped_at"]
    deadline = time.monotonic() + 4 * peer_timeout_s + 10
    found: dict[int, Any] = {}
    while time.monotonic() < deadline:
        time.sleep(0.25)
        found = {p: f for a in group.all("found") for p, f in a["found"].items() if p != victim}
        if all(f is not None for f in found.values()):
            break
    group.all("stop_watchdogs")
    delays = sorted(f[0] - stopped_at for f in found.values() if f is not None)
    named = sum(1 for f in found.values() if f is not None and f"lost process(es) [{victim}]" in f[1])
    interval = max(0.05, min(peer_timeout_s / 10, 1.0))  # Watchdog.interval
    return {
        "steady_s": elapsed,
        # one read a round each: the aggregator's of every heartbeat, the others' of its summary
        "rounds_per_s": (counts["by_call"].get("key_value_dir_get", 0) + counts["by_call"].get("key_value_try_get", 0))
        / elapsed
        / group.n,
        "interval_s": interval,
        "requests_per_s": counts["requests"] / elapsed,
        "bytes_per_s": (counts["sent"] + counts["received"]) / elapsed,
        "service_cpu_per_s": cpu / elapsed,
        "observers": observers,
        "survivors": len(found),
        "knew": len(delays),
        "named": named,
        "first_s": delays[0] if delays else None,
        "median_s": statistics.median(delays) if delays else None,
        "all_s": delays[-1] if len(delays) == len(found) and delays else None,
        "reasons": sorted({f[1][:120] for f in found.values() if f is not None})[:3],
    }


# ----------------------------------------------------------------- real processes (--real)

REAL_WORKER = """
import sys, time
import jddp
jddp.initialize(verbose=False)
print("JOINED", flush=True)
time.sleep(float(sys.argv[1]))
"""


def real(num_processes: int, peer_timeout_s: float, window_s: float, settle_s: float = 5.0) -> dict[str, Any]:
    """``jddp launch -n N`` of real processes (JAX imported, ``jddp.initialize``: the group joined and every
    watchdog running, then idle): the coordination service's CPU per second over ``window_s`` once every process
    has joined (the launcher's service, ``python -m jddp.runtime.coordinator``, found among its children), the
    figure the simulator's ``wd cpu/s`` gives at the same N. Also the time from the launch to the last join."""
    validate.check_int("num_processes", num_processes, minimum=2)
    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        script = os.path.join(folder, "idle.py")
        with open(script, "w") as f:
            f.write(REAL_WORKER)
        env = {**os.environ, "JDDP_COMPILATION_CACHE": "0"}
        env.pop("XLA_FLAGS", None)
        argv = [sys.executable, "-m", "jddp.launch", "-n", str(num_processes), "--peer-timeout", str(peer_timeout_s)]
        argv += ["--max-restarts", "0", script, str(window_s + settle_s + 600)]
        start = time.monotonic()
        launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        stack.callback(launcher.kill)
        joined: list[float] = []
        service = None
        deadline = start + 600
        assert launcher.stdout is not None
        for line in launcher.stdout:
            if "JOINED" in line:  # the worker's line once jddp.initialize has returned (the group joined)
                joined.append(time.monotonic() - start)
                if len(joined) == num_processes:
                    break
            if time.monotonic() > deadline or launcher.poll() is not None:
                raise RuntimeError(f"real N={num_processes}: {len(joined)} of the processes joined: {line}")
        threading.Thread(target=lambda: [None for _ in launcher.stdout], daemon=True).start()  # keep the pipe open
        for child in _children(launcher.pid):
            with contextlib.suppress(OSError):
                if b"jddp.runtime.coordinator" in open(f"/proc/{child}/cmdline", "rb").read():
                    service = child
        if service is None:
            raise RuntimeError(f"real N={num_processes}: the launcher's coordination service was not found")
        time.sleep(settle_s)
        cpu0, w0 = cpu_s(service), time.monotonic()
        time.sleep(window_s)
        cpu = (cpu_s(service) - cpu0) / (time.monotonic() - w0)
        launcher.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.wait(timeout=60)
    return {"n": num_processes, "service_cpu_per_s": cpu, "joined_s": max(joined), "load": loadavg()}


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (``/proc/<pid>/task/*/children``)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(k) for k in f.read().split()]
                found += kids
                todo += kids
    return found


def table(results: Sequence[dict[str, Any]]) -> str:
    columns = [
        ("join s", lambda r: r["join_s"]),
        ("restart s", lambda r: r["restart"]["restart_s"]),
        ("rejoin s", lambda r: r["restart"]["join_s"]),
        ("hb req", lambda r: r["heartbeat"]["requests"]),
        ("hb values", lambda r: r["heartbeat"]["values"]),
        ("hb bytes", lambda r: r["heartbeat"]["bytes"]),
        ("hb cpu ms", lambda r: r["heartbeat"]["service_cpu_net_ms"]),
        ("hb p50 ms", lambda r: r["heartbeat"]["p50_ms"]),
        ("hb group ms", lambda r: r["heartbeat"]["group_ms"]),
        ("hb-all bytes", lambda r: r["heartbeat_all_read"]["bytes"]),
        ("hb-all cpu ms", lambda r: r["heartbeat_all_read"]["service_cpu_net_ms"]),
        ("bar req", lambda r: r["barrier"]["requests"]),
        ("bar bytes", lambda r: r["barrier"]["bytes"]),
        ("bar cpu ms", lambda r: r["barrier"]["service_cpu_net_ms"]),
        ("bar ms", lambda r: r["barrier"]["group_ms"]),
        ("ag req", lambda r: r["all_gather"]["requests"]),
        ("ag bytes", lambda r: r["all_gather"]["bytes"]),
        ("ag cpu ms", lambda r: r["all_gather"]["service_cpu_net_ms"]),
        ("ag ms", lambda r: r["all_gather"]["group_ms"]),
        ("wd cpu/s", lambda r: r["detection"]["service_cpu_per_s"] if "detection" in r else None),
        ("wd rounds/s", lambda r: r["detection"]["rounds_per_s"] if "detection" in r else None),
        ("detect all s", lambda r: r["detection"]["all_s"] if "detection" in r else None),
    ]

    def safe(get):
        def value(r):
            try:
                return get(r)
            except KeyError:  # an exchange not measured (--ops)
                return None

        return value

    columns = [(name, safe(get)) for name, get in columns]

    def fmt(v) -> str:
        if v is None:
            return "-"
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"

    lines = ["| N | load | " + " | ".join(c for c, _ in columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for r in results:
        load = f"{r['load_start']:.1f}-{r['load_end']:.1f}"
        lines.append(f"| {r['n']} | {load} | " + " | ".join(fmt(get(r)) for _, get in columns) + " |")
    ns = [r["n"] for r in results]
    slopes = []
    for _, get in columns:
        values = [get(r) for r in results]
        ok = [(n, v) for n, v in zip(ns, values, strict=True) if v is not None]
        slopes.append(slope([n for n, _ in ok], [v for _, v in ok]) if len(ok) > 1 else float("nan"))
    lines.append("| slope | | " + " | ".join(f"{s:.2f}" for s in slopes) + " |")
    return "\n".join(lines)


def parse_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--n={text!r} must be process counts separated by commas, e.g. 2,8,32") from None
    if not counts or any(n < 2 for n in counts):
        raise ValueError(f"--n={text!r}: every process count must be at least 2, e.g. 2,8,32")
    return counts


QUICK: dict[str, Any] = {"n": "2", "reps": 2, "warmup": 1.0, "workers": 1}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", default="2,8,32,128", help="process counts, comma-separated")
    parser.add_argument("--workers", type=int, default=4, help="OS processes hosting the simulated ones")
    parser.add_argument("--reps", type=int, default=10, help="repetitions of each exchange (medians)")
    parser.add_argument("--peer-timeout", type=float, default=5.0, help="the watchdog's peer timeout (s)")
    parser.add_argument("--warmup", type=float, default=3.0, help="watchdogs' steady state before the stop (s)")
    parser.add_argument("--no-detection", action="store_true", help="skip the watchdogs and failure detection")
    parser.add_argument(
        "--observers",
        type=int,
        default=None,
        help="only processes below this run jddp's Watchdog and are timed; the others make its calls without "
        "judging (the simulator's own CPU: N watchdogs parse N^2 values a round)",
    )
    parser.add_argument(
        "--service-heartbeat",
        type=int,
        default=None,
        help="JAX's own heartbeat timeout of each client (s; default: the peer timeout + 15, as jddp sets it)",
    )
    parser.add_argument("--ops", default=",".join(OPS), help="the exchanges to measure, comma-separated (or none)")
    parser.add_argument(
        "--at-step",
        type=int,
        default=AT_STEP,
        help="the simulated processes' heartbeat values are those of a run at this step (0: before any step)",
    )
    parser.add_argument(
        "--real",
        action="store_true",
        help="real processes instead (jddp launch -n N, idle after joining): the service's CPU per second over "
        "--window s, and the time to the last join, for each N; then the simulator's wd cpu/s at the same N",
    )
    parser.add_argument("--window", type=float, default=20.0, help="--real: seconds the service's CPU is taken over")
    return parser


def bench(args: argparse.Namespace) -> Any:
    counts = parse_counts(args.n)
    if args.real:
        rows = []
        for n in counts:
            r = real(n, args.peer_timeout, args.window)
            sim = measure(
                n, workers=args.workers, peer_timeout_s=args.peer_timeout, warmup_s=args.window, ops=[], at_step=0
            )  # the real processes are idle: heartbeat values of a process before any step
            r["sim_service_cpu_per_s"] = sim["detection"]["service_cpu_per_s"]
            rows.append(r)
            print(json.dumps(r), flush=True)
        print("| N | real: service CPU s/s | simulator | real / simulator | real: last join s | load |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            ratio = r["service_cpu_per_s"] / r["sim_service_cpu_per_s"] if r["sim_service_cpu_per_s"] else math.nan
            print(
                f"| {r['n']} | {r['service_cpu_per_s']:.4f} | {r['sim_service_cpu_per_s']:.4f} | {ratio:.2f} | "
                f"{r['joined_s']:.1f} | {r['load']:.1f} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": list(sys.argv), "real": rows}, f, indent=1)
        return {"real": rows}
    results = []
    for n in counts:
        r = measure(
            n,
            workers=args.workers,
            reps=args.reps,
            peer_timeout_s=args.peer_timeout,
            warmup_s=args.warmup,
            detection=not args.no_detection,
            observers=args.observers,
            service_heartbeat_s=args.service_heartbeat,
            ops=[op for op in args.ops.split(",") if op and op != "none"],
            at_step=args.at_step,
        )
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": list(sys.argv), "results": results}, f, indent=1)
    print(table(results))
    return {"results": results}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
