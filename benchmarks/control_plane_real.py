"""What does each per-round control-plane exchange cost with real jddp processes, beside the simulator's?

Every per-round control-plane cost with real jddp processes, beside the simulator's at the same N.

    python -m benchmarks control_plane_real [--n 2,4,8,16,32] [--reps 20] [--peer-timeout 5] [--window 10]

For each N: ``jddp launch -n N --devices-per-process 1 --peer-timeout T`` of this module as the script
(``--worker``): real processes that import JAX and join the group with ``jddp.initialize`` (gloo on CPU, the
coordination service in the launcher's process of its own). Each one counts its own calls to the coordination
service with the simulator's ``Counted`` proxy (``benchmarks/control_plane.py``): jddp takes the client from
``jddp.runtime.jax_internals.distributed_client`` every time it needs it (``jddp.initialize`` for the watchdog,
``jddp.barrier``, the host collectives), so ``install`` replaces that function, before ``jddp.initialize``, by one
that returns the real client wrapped (``Split``), jddp itself unchanged. ``Split`` counts a call in ``main`` when
the main thread asked for it (``jddp.barrier``, ``jddp.host_all_gather``, and the watchdog's ``announce`` of a
collective call, which the main thread makes through the watchdog's key-value thread) and in ``background``
otherwise (the watchdog's rounds). Then, in sequence, every process:

* ``watchdog``: stays idle ``--window`` s: its watchdog's rounds (their number: its reads, one a round, the
  aggregator's of every heartbeat or another's of the summary) and their calls (``background``); the service's
  CPU per second meanwhile (``/proc/<pid>/stat`` of the launcher's ``python -m jddp.runtime.coordinator``, read
  by process 0). Per round for the group: the sum over processes of each one's requests and bytes per round of
  its own; the service's CPU per round is its CPU per second over the rounds per second (JAX's own client
  heartbeats included, on both sides);
* ``barrier``: ``--reps`` calls of ``jddp.barrier``; ``barrier_quiet``: the same without the watchdog's
  ``announce`` (``progress.ANNOUNCE`` unset around it: the calls the simulator makes); ``all_gather``: of
  ``jddp.host_all_gather`` of a small dict (the simulator's ``SMALL_VALUE``); ``preemption``: of the
  Checkpointer's preemption exchange (``jddp.checkpoint.preemption.Preemption.reached`` with ``check_s=0``: an
  exchange at every call, a ``multihost_utils.process_allgather`` over gloo); ``agree``: of the Checkpointer's
  save agreement (``preemption.all_agree``, one gloo all-gather). Each after one warm-up call (for the gloo ones,
  ``first``: the compilation and gloo's connections, whose key-value traffic goes through the service from C++,
  uncounted by the proxy but in the service's CPU). Latency: ``group`` is from the last process's arrival to the
  last one's return (CLOCK_MONOTONIC, shared by the processes of one machine), the median over the repetitions;
  the requests and bytes per call, summed over the processes; the service's CPU per call, less its rate while
  idle (with the watchdogs running, as during the calls) and less the one ``jddp.barrier`` that closes the
  window;
* ``detection``: the processes idle again; this script SIGSTOPs the last process (a frozen one) and times until
  each survivor says on stderr that it lost it (``jddp: process p of N lost process(es) [N-1]``, the watchdog's
  line), against the documented bound T + 10 s (docs/guides/launch.md, the failure table).

Then the simulator (``control_plane.measure``) at the same N, peer timeout and repetitions, heartbeat values of a
process before any step (``at_step=0``), in the same run: its heartbeat round, barrier, all-gather and detection.
The tables give each figure real, simulated and their ratio, per N, and the slope of log(figure) on log(N) (least
squares) of each. The gloo agreements have no simulated figure (the simulator has no devices). Counts are
exact per call (the same at every repetition); CPU times are totals over the repetitions divided by their number
(the kernel counts them in 10 ms ticks); latencies are medians.

``--sim-workers``: the simulator's OS processes (4 by default, as its own default). The clients of one process
share one connection to the service (gRPC shares a connection between channels to one address in a process:
``service sockets``, the service's open sockets, its listening one included); N real processes make N.

Where real and simulated differ, and why (2-core VM, 26 Nov 2026, ``--reps 20 --peer-timeout 5 --window 10``, a
noisy machine: load 8 to 14 from other work; N = 2, 4, 8 from 15:32 to 15:36 UTC, N = 32 from 15:36 to 15:38):

* the barrier's and the all-gather's requests, 3 and 5 a process real against 2 and 4 simulated (1.5 and 1.25
  times), and their bytes (3.7 times the simulator's for the barrier, 1.1 to 1.8 for the all-gather): both are
  collective calls (``progress.collective_call``) that publish this process's heartbeat value as they begin
  (``Watchdog.announce``, a ``key_value_set`` of the value with the names of the last collective calls, about 150
  bytes), a call the simulator's ``SimProcess.barrier`` and ``all_gather`` left out then (they make it since:
  ``SimProcess.announce``, so the rows compare like for like). ``barrier_quiet``, the barrier without it, made
  the simulator's calls of then under its keys: its requests and bytes were the simulator's exactly (ratio 1.00
  at every N). The announce is also most of the barrier's extra latency at N = 2 to 8: 1.5 to
  2.8 times the simulator's group time with it, 0.96 to 1.45 without (one more round trip, through the watchdog's
  key-value thread, before the barrier's own calls);
* the service's CPU per round or call, and the latencies, at N = 32: 1.4 to 1.7 times the simulator's CPU (the
  watchdog round 30.4 ms against 18; the quiet barrier 13.4 ms against 9.5), 2.2 to 2.8 times its group times
  (the quiet barrier 47 ms against 17, the all-gather 107 against 48). Not the protocol (the same calls and
  bytes) but the connections: the simulator's 32 clients in 4 processes reach the service over 4 connections,
  the real processes over 32. The simulator with 32 workers, one client each (``control_plane.measure(32,
  workers=32)``, 15:40 to 15:45 UTC, load 18 to 34) gave the real figures within a quarter: the watchdog round
  28.5 ms of service CPU (real 30.4), the barrier 15.9 ms and 55 ms of group time (real, quiet: 13.4 and 47), the
  all-gather 30.6 ms and 84 ms (real 32.3 and 107); with 4 workers in the same minutes 20, 9.8 and 19 ms, 19.1
  and 45 ms. At N = 2 to 8 the CPU ratios are 0.6 to 1.8 (a few ms a call, counted in 10 ms ticks);
* the watchdog round's requests are the same (2N + 1), its bytes 1.1 times the simulator's (the real
  values carry the names of the collective calls made), its pace 0.95 to 1.0 times;
* the Checkpointer's gloo agreements ask nothing of the service through jddp's client (0 requests a call) and
  cost it nothing measurable per call; their first call (the program's compilation and gloo's connections, whose
  rendezvous goes through the service's key-value store from C++: every process publishes its addresses and
  reads every peer's, N(N - 1) reads at least) took 10, 30, 50 and 540 ms of the service's CPU at N = 2, 4, 8
  and 32 (slope 1.7 from 8 to 32), once per run and set of devices;
* failure detection: real and simulated within 6% of each other, every survivor naming the stopped process 4.8
  to 5.5 s after the stop at T = 5 s (bound T + 10 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import control_plane, harness
from jddp import validate

OPS = ("barrier", "barrier_quiet", "all_gather", "preemption", "agree")
SYNC = "cp-sync"  # the barrier that separates the phases (its calls are outside every window counted)
RESULT = "CONTROL-PLANE-REAL "  # process 0's line with every figure (JSON after it)
JOINED = "CONTROL-PLANE-JOINED "  # each process's line once joined: its process index and pid
LOST_LINE = re.compile(r"jddp: process (\d+) of \d+ lost process\(es\) \[([0-9, ]*)\]")
BOUND_EXTRA_S = 10.0  # the documented detection bound is T + 10 s (docs/guides/launch.md)


# ----------------------------------------------------------------- counting inside a real process


class Split:
    """A coordination-service client that counts each call with the simulator's ``Counted``: in ``main`` when the
    main thread asked for the method (``jddp.barrier``, the host collectives, the watchdog's ``announce``), in
    ``background`` otherwise (the watchdog's rounds, run by its key-value thread)."""

    def __init__(self, client: Any):
        self.client = client
        self.main = control_plane.Counted(client)
        self.background = control_plane.Counted(client)

    def __getattr__(self, name: str):
        counted = self.main if threading.current_thread() is threading.main_thread() else self.background
        return getattr(counted, name)


def install() -> None:
    """Replaces ``jddp.runtime.jax_internals.distributed_client`` by one returning JAX's client wrapped in a
    ``Split`` (the same one for the same client; None while JAX has none), except to jax_internals itself, which
    passes it to C++; call before ``jddp.initialize``, whose watchdog keeps the client it is given. ``split()``
    gives that ``Split``."""
    from jddp.runtime import jax_internals

    original = jax_internals.distributed_client
    holder: list[Split] = []

    def distributed_client() -> Any | None:
        client = original()
        if client is None or sys._getframe(1).f_globals.get("__name__") == jax_internals.__name__:
            return client  # jax_internals hands it to JAX's C++ (gloo's collectives), which takes only the real one
        if not holder or holder[0].client is not client:
            holder[:] = [Split(client)]
        return holder[0]

    distributed_client.holder = holder  # type: ignore[attr-defined]
    jax_internals.distributed_client = distributed_client


def split() -> Split:
    """The ``Split`` that ``install`` made (after ``jddp.initialize``)."""
    from jddp.runtime import jax_internals

    holder = getattr(jax_internals.distributed_client, "holder", None)
    if not holder:
        raise RuntimeError("control_plane_real.split: install() was not called, or no client was asked for yet")
    return holder[0]


def snapshot(counted: control_plane.Counted) -> dict[str, Any]:
    """A ``Counted``'s counts so far, not reset (another thread may be counting)."""
    return {
        "requests": sum(dict(counted.requests).values()),
        "by_call": dict(counted.requests),
        "sent": counted.sent,
        "received": counted.received,
        "values": counted.values_received,
    }


def since(before: dict[str, Any], after: dict[str, Any], per: float = 1.0) -> dict[str, Any]:
    """The counts between two snapshots, divided by ``per``."""
    by_call = {k: (v - before["by_call"].get(k, 0)) / per for k, v in after["by_call"].items()}
    return {
        "requests": (after["requests"] - before["requests"]) / per,
        "by_call": {k: v for k, v in by_call.items() if v},
        "bytes": (after["sent"] + after["received"] - before["sent"] - before["received"]) / per,
        "values": (after["values"] - before["values"]) / per,
    }


# ----------------------------------------------------------------- the worker (one jddp process)


def find_service() -> int:
    """The pid of the launcher's coordination service (``python -m jddp.runtime.coordinator``), a child of this
    process's parent (the launcher)."""
    for child in control_plane._children(os.getppid()):
        with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as f:
            if b"jddp.runtime.coordinator" in f.read():
                return child
    raise RuntimeError("control_plane_real: the launcher's coordination service was not found among its children")


def timed_calls(fn: Callable[[], Any], reps: int) -> list[tuple[float, float]]:
    out = []
    for _ in range(reps):
        start = time.monotonic()
        fn()
        out.append((start, time.monotonic()))
    return out


def worker(reps: int, window_s: float) -> None:
    install()
    import jddp
    from jddp.checkpoint import preemption
    from jddp.runtime import distributed, progress, watchdog

    jddp.initialize(verbose=False)
    group = distributed.group()
    if group is None:
        raise RuntimeError("control_plane_real --worker: run under jddp launch -n N with N >= 2")
    me = group.process_id
    counts = split()
    service = find_service() if me == 0 else None

    def cpu() -> float:
        return control_plane.cpu_s(service) if service is not None else 0.0

    print(f"{JOINED}{me} {os.getpid()}", flush=True)
    mine: dict[str, Any] = {"process": me}
    figures: dict[str, Any] = {}

    jddp.barrier(SYNC)
    c0, cpu0, t0 = snapshot(counts.background), cpu(), time.monotonic()
    time.sleep(window_s)
    c1, cpu1, t1 = snapshot(counts.background), cpu(), time.monotonic()
    # a round reads once: the aggregator every heartbeat, the others its summary (as the simulator counts them)
    read = "key_value_dir_get" if me == watchdog.AGGREGATOR else "key_value_try_get"
    rounds = max(c1["by_call"].get(read, 0) - c0["by_call"].get(read, 0), 1)
    mine["watchdog"] = {**since(c0, c1, rounds), "rounds_per_s": rounds / (t1 - t0)}
    idle = (cpu1 - cpu0) / (t1 - t0)
    figures["idle_cpu_per_s"] = idle
    figures["service_sockets"] = control_plane.sockets(service) if service is not None else 0

    agreement = preemption.Preemption(check_s=0.0)
    step = [0]

    def exchange() -> None:
        step[0] += 1
        agreement.reached(step[0])

    def quiet_barrier() -> None:
        announce, progress.ANNOUNCE = progress.ANNOUNCE, None
        try:
            jddp.barrier("sim")  # the simulator's name: the same keys as its barrier, byte for byte
        finally:
            progress.ANNOUNCE = announce

    calls: dict[str, Callable[[], Any]] = {
        "barrier": lambda: jddp.barrier("cp"),
        "barrier_quiet": quiet_barrier,
        "all_gather": lambda: jddp.host_all_gather(control_plane.SMALL_VALUE),
        "preemption": exchange,
        "agree": lambda: preemption.all_agree(True),
    }
    barrier_cpu = 0.0
    for op in OPS:
        jddp.barrier(SYNC)
        s0, cpu0 = snapshot(counts.main), cpu()
        first = timed_calls(calls[op], 1)[0]  # the warm-up: compilation, gloo's connections
        jddp.barrier(SYNC)
        s1, cpu1 = snapshot(counts.main), cpu()
        w0 = time.monotonic()
        times = timed_calls(calls[op], reps)
        s2 = snapshot(counts.main)
        jddp.barrier(SYNC)
        cpu2, w1 = cpu(), time.monotonic()
        mine[op] = {"first": first, "times": times, **since(s1, s2, reps)}
        # the service's CPU per call, less its idle rate (watchdogs included) and the closing barrier
        net = (cpu2 - cpu1 - idle * (w1 - w0)) / reps - barrier_cpu / reps
        if op == "barrier":  # the first: the closing barrier is one more of the same
            net = (cpu2 - cpu1 - idle * (w1 - w0)) / (reps + 1)
            barrier_cpu = net
        figures[op] = {"service_cpu_ms": 1e3 * net, "first_service_cpu_ms": 1e3 * (cpu1 - cpu0), **since(s0, s1)}
    agreement.close()
    everyone = jddp.host_all_gather(mine)
    if me == 0:
        print(RESULT + json.dumps({"n": group.num_processes, "figures": figures, "processes": everyone}), flush=True)
    jddp.barrier(SYNC)
    print(f"CONTROL-PLANE-IDLE {me}", flush=True)
    time.sleep(3600)  # until the launcher ends the group (detection)


# ----------------------------------------------------------------- the driver


def combine(raw: dict[str, Any]) -> dict[str, Any]:
    """Process 0's line: the group's figures per call and per round."""
    procs = raw["processes"]
    out: dict[str, Any] = {"n": raw["n"], **{k: raw["figures"][k] for k in ("idle_cpu_per_s", "service_sockets")}}
    wd = [p["watchdog"] for p in procs]
    rounds_per_s = statistics.median(w["rounds_per_s"] for w in wd)
    out["watchdog"] = {
        "requests": sum(w["requests"] for w in wd),
        "bytes": sum(w["bytes"] for w in wd),
        "values": sum(w["values"] for w in wd),
        "by_call": control_plane.add_counts([{**w, "sent": 0, "received": 0} for w in wd])["by_call"],
        "rounds_per_s": rounds_per_s,
        "service_cpu_ms": 1e3 * raw["figures"]["idle_cpu_per_s"] / rounds_per_s,
    }
    for op in OPS:
        per = [p[op] for p in procs]
        reps = len(per[0]["times"])
        groups = [
            max(p["times"][k][1] for p in per) - max(p["times"][k][0] for p in per) for k in range(reps)
        ]  # the last arrival to the last return
        by_call: dict[str, float] = {}
        for p in per:
            for k, v in p["by_call"].items():
                by_call[k] = by_call.get(k, 0) + v
        out[op] = {
            "requests": sum(p["requests"] for p in per),
            "bytes": sum(p["bytes"] for p in per),
            "by_call": by_call,
            "group_ms": 1e3 * statistics.median(groups),
            "p50_ms": 1e3 * statistics.median(e - s for p in per for s, e in p["times"]),
            "first_group_ms": 1e3 * (max(p["first"][1] for p in per) - max(p["first"][0] for p in per)),
            "service_cpu_ms": raw["figures"][op]["service_cpu_ms"],
            "first_service_cpu_ms": raw["figures"][op]["first_service_cpu_ms"],
        }
    return out


def real(num_processes: int, reps: int, peer_timeout_s: float, window_s: float) -> dict[str, Any]:
    """One launch of N real processes: every phase, then the detection."""
    validate.check_int("num_processes", num_processes, minimum=2)
    env = {**os.environ, "JDDP_COMPILATION_CACHE": "0"}
    env.pop("XLA_FLAGS", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "jddp.launch", "-n", str(num_processes), "--devices-per-process", "1"]
    argv += ["--peer-timeout", str(peer_timeout_s), "--max-restarts", "0", "-m", "benchmarks.control_plane_real"]
    argv += ["--worker", "--reps", str(reps), "--window", str(window_s)]
    load = control_plane.loadavg()
    start = time.monotonic()
    launcher = subprocess.Popen(
        argv, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[tuple[float, str]] = []
    ready = threading.Event()
    pids: dict[int, int] = {}
    idle: set[int] = set()
    raw: list[dict[str, Any]] = []

    def read() -> None:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            now = time.monotonic()
            lines.append((now, line))
            if JOINED in line:
                p, pid = line.split(JOINED, 1)[1].split()
                pids[int(p)] = int(pid)
            elif RESULT in line:
                raw.append(json.loads(line.split(RESULT, 1)[1]))
            elif "CONTROL-PLANE-IDLE" in line:
                idle.add(int(line.rsplit(None, 1)[1]))
                if len(idle) == num_processes:
                    ready.set()
        ready.set()  # the launcher ended (early: an error, shown below)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    victim = num_processes - 1
    try:
        ready.wait(timeout=1800)
        if not raw or len(idle) < num_processes:
            tail = "".join(line for _, line in lines[-40:])
            raise RuntimeError(f"real N={num_processes}: the processes did not get through the phases:\n{tail}")
        joined_s = max(t for t, line in lines if JOINED in line) - start
        result = combine(raw[0])
        time.sleep(1.0)
        stopped_at = time.monotonic()
        os.kill(pids[victim], signal.SIGSTOP)
        survivors = set(range(num_processes)) - {victim}
        found: dict[int, float] = {}
        deadline = stopped_at + peer_timeout_s + BOUND_EXTRA_S + 30
        while time.monotonic() < deadline and set(found) != survivors:
            for t, line in list(lines):
                m = LOST_LINE.search(line)
                if m and int(m.group(1)) in survivors and victim in {int(x) for x in m.group(2).split(",") if x}:
                    found.setdefault(int(m.group(1)), t - stopped_at)
            time.sleep(0.1)
        delays = sorted(found.values())
        result["detection"] = {
            "survivors": len(survivors),
            "named": len(found),
            "first_s": delays[0] if delays else None,
            "median_s": statistics.median(delays) if delays else None,
            "all_s": delays[-1] if len(found) == len(survivors) else None,
            "bound_s": peer_timeout_s + BOUND_EXTRA_S,
        }
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        for pid in pids.values():  # none should be left; a stopped one would never go away by itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        reader.join(timeout=10)
    result.update(joined_s=joined_s, load_start=load, load_end=control_plane.loadavg())
    return result


def simulated(num_processes: int, reps: int, peer_timeout_s: float, window_s: float, workers: int) -> dict[str, Any]:
    """The simulator's figures at the same settings (heartbeat values of a process before any step, as the real
    ones, which make no step), its N clients in ``workers`` processes."""
    r = control_plane.measure(
        num_processes,
        workers=workers,
        reps=reps,
        peer_timeout_s=peer_timeout_s,
        warmup_s=window_s,
        ops=["heartbeat", "barrier", "all_gather"],
        at_step=0,
    )
    return r


# What the tables show: (title, columns); a column is (heading, real's figure, the simulator's or None); a
# simulated figure comes with the ratio real / simulated.
Getter = Callable[[dict[str, Any]], Any]
COLUMNS: list[tuple[str, list[tuple[str, Getter, Getter | None]]]] = [
    (
        "watchdog round (per round, the group)",
        [
            ("req", lambda r: r["watchdog"]["requests"], lambda s: s["heartbeat"]["requests"]),
            ("bytes", lambda r: r["watchdog"]["bytes"], lambda s: s["heartbeat"]["bytes"]),
            (
                "service cpu ms",
                lambda r: r["watchdog"]["service_cpu_ms"],
                lambda s: 1e3 * s["detection"]["service_cpu_per_s"] / s["detection"]["rounds_per_s"],
            ),
            ("rounds/s", lambda r: r["watchdog"]["rounds_per_s"], lambda s: s["detection"]["rounds_per_s"]),
            ("service sockets", lambda r: r["service_sockets"], lambda s: s["service_sockets"]),
        ],
    ),
    (
        "jddp.barrier (per call, the group; quiet: without the watchdog's announce)",
        [
            ("req", lambda r: r["barrier"]["requests"], lambda s: s["barrier"]["requests"]),
            ("bytes", lambda r: r["barrier"]["bytes"], lambda s: s["barrier"]["bytes"]),
            ("service cpu ms", lambda r: r["barrier"]["service_cpu_ms"], lambda s: s["barrier"]["service_cpu_net_ms"]),
            ("group ms", lambda r: r["barrier"]["group_ms"], lambda s: s["barrier"]["group_ms"]),
            ("quiet req", lambda r: r["barrier_quiet"]["requests"], None),
            ("quiet bytes", lambda r: r["barrier_quiet"]["bytes"], None),
            ("quiet service cpu ms", lambda r: r["barrier_quiet"]["service_cpu_ms"], None),
            ("quiet group ms", lambda r: r["barrier_quiet"]["group_ms"], None),
        ],
    ),
    (
        "jddp.host_all_gather of a small dict (per call, the group)",
        [
            ("req", lambda r: r["all_gather"]["requests"], lambda s: s["all_gather"]["requests"]),
            ("bytes", lambda r: r["all_gather"]["bytes"], lambda s: s["all_gather"]["bytes"]),
            (
                "service cpu ms",
                lambda r: r["all_gather"]["service_cpu_ms"],
                lambda s: s["all_gather"]["service_cpu_net_ms"],
            ),
            ("group ms", lambda r: r["all_gather"]["group_ms"], lambda s: s["all_gather"]["group_ms"]),
        ],
    ),
    (
        "the Checkpointer's gloo agreements (real only: the simulator has no devices)",
        [
            ("preemption group ms", lambda r: r["preemption"]["group_ms"], None),
            ("its first call ms", lambda r: r["preemption"]["first_group_ms"], None),
            ("first: service cpu ms", lambda r: r["preemption"]["first_service_cpu_ms"], None),
            ("save agreement group ms", lambda r: r["agree"]["group_ms"], None),
            ("service cpu ms a call", lambda r: r["agree"]["service_cpu_ms"], None),
            ("service req a call", lambda r: r["preemption"]["requests"] + r["agree"]["requests"], None),
        ],
    ),
    (
        "failure detection (the last process SIGSTOPped; bound T + 10 s)",
        [
            ("named by", lambda r: r["detection"]["named"], None),
            ("sim: named by", lambda r: r["sim"]["detection"]["knew"], None),
            ("first s", lambda r: r["detection"]["first_s"], lambda s: s["detection"]["first_s"]),
            ("all s", lambda r: r["detection"]["all_s"], lambda s: s["detection"]["all_s"]),
            ("bound s", lambda r: r["detection"]["bound_s"], None),
        ],
    ),
]


def fmt(v: Any) -> str:
    if v is None or v != v:
        return "-"
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"


def tables(rows: Sequence[dict[str, Any]]) -> str:
    """One table per exchange: each figure real, simulated and real / simulated, per N; a last row with the slope
    of log(figure) on log(N) of each column."""

    def get(fn: Getter | None, r: dict[str, Any]) -> Any:
        if fn is None:
            return None
        try:
            return fn(r)
        except (KeyError, TypeError, ZeroDivisionError):  # not measured (--no-sim, a detection that failed)
            return None

    out = []
    for title, columns in COLUMNS:
        heads: list[str] = []
        values: list[list[Any]] = [[] for _ in rows]
        for name, real_fn, sim_fn in columns:
            heads += [name] if sim_fn is None else [f"{name} real", f"{name} sim", f"{name} real/sim"]
            for k, row in enumerate(rows):
                a = get(real_fn, {**row["real"], "sim": row["sim"]})
                if sim_fn is None:
                    values[k].append(a)
                    continue
                b = get(sim_fn, row["sim"])
                values[k] += [a, b, a / b if a is not None and b else None]
        slopes = []
        for j, head in enumerate(heads):
            if head.endswith("real/sim"):
                slopes.append(None)
                continue
            ok = [(row["n"], v[j]) for row, v in zip(rows, values, strict=True) if v[j] is not None]
            slopes.append(control_plane.slope([n for n, _ in ok], [v for _, v in ok]) if len(ok) > 1 else None)
        lines = [f"\n{title}", "| N | load | " + " | ".join(heads) + " |", "|---" * (len(heads) + 2) + "|"]
        for row, v in zip(rows, values, strict=True):
            load = f"{row['real']['load_start']:.1f}"
            lines.append(f"| {row['n']} | {load} | " + " | ".join(fmt(x) for x in v) + " |")
        lines.append("| slope | | " + " | ".join("-" if x is None or x != x else f"{x:.2f}" for x in slopes) + " |")
        out.append("\n".join(lines))
    return "\n".join(out)


QUICK: dict[str, Any] = {"n": "2", "reps": 2, "window": 2.0, "no_sim": True}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", default="2,4,8,16,32", help="process counts, comma-separated")
    parser.add_argument("--reps", type=int, default=20, help="repetitions of each call (medians)")
    parser.add_argument("--peer-timeout", type=float, default=5.0, help="the watchdog's peer timeout T (s)")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of the watchdogs' steady state")
    parser.add_argument("--no-sim", action="store_true", help="real processes only")
    parser.add_argument(
        "--sim-workers",
        type=int,
        default=4,
        help="the simulator's OS processes (its --workers; as many as N: one connection to the service per client, "
        "as real processes make)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one jddp process (jddp launch)
    return parser


def bench(args: argparse.Namespace) -> Any:
    validate.check_int("--reps", args.reps, minimum=1)
    validate.check_number("--peer-timeout", args.peer_timeout, unit="seconds")
    validate.check_number("--window", args.window, unit="seconds")
    validate.check_int("--sim-workers", args.sim_workers, minimum=1)
    if args.worker:
        worker(args.reps, args.window)
        return 0
    rows = []
    for n in control_plane.parse_counts(args.n):
        row: dict[str, Any] = {"n": n, "real": real(n, args.reps, args.peer_timeout, args.window)}
        print(f"N={n} real: {json.dumps(row['real'])}", file=sys.stderr, flush=True)
        row["sim"] = {} if args.no_sim else simulated(n, args.reps, args.peer_timeout, args.window, args.sim_workers)
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"argv": list(sys.argv), "rows": rows}, f, indent=1)
    print(tables(rows))
    return {"rows": rows}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
