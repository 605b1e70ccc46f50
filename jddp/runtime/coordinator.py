"""The group's coordination service in a process of its own (``jddp launch`` starts one per attempt).

JAX starts the coordination service (the key-value store, barriers and
heartbeats every process of a group relies on) inside process 0's
``jax.distributed.initialize``. When process 0 dies, the service dies with it,
and JAX's client in every survivor aborts the process from C++ at once (exit
134, "the distributed service detected fatal errors"): no Python runs, nothing
names process 0. torchrun avoids the same trap by keeping its store in the agent,
not in a worker.

``jddp launch`` does the same: on node 0 it runs this module for each attempt::

    python -m jddp.runtime.coordinator HOST:PORT NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S

and tells the processes (``JDDP_COORDINATOR_HOSTED=1``) that the service at
``JDDP_COORDINATOR`` is already running, so process 0 joins it as a client like
everyone else. Losing process 0 is then like losing any other: the survivors'
watchdogs find it silent and exit 69 naming it.

Runs started without the launcher (SLURM's ``srun``, a hand-written script)
get the same: process 0's ``jddp.initialize`` starts this module as a child
(``start_for_parent``) with ``--parent PID --grace S``. The child ends when
process 0 stops it at its normal exit (after JAX's shutdown barrier), or, when
process 0 died instead, ``S`` seconds after (time for the survivors to name it
and exit 69). That child ignores SIGTERM, SIGINT and SIGHUP, and process 0 stops
it with SIGUSR1: a scheduler's SIGTERM reaches every process of the job
(``scancel``, ``mpiexec``, a terminal's Ctrl-C to the process group), and the
service must outlive it while the processes agree on and write their
preemption checkpoint.

Under the launcher, the service runs until SIGTERM or SIGINT. It prints one line
when it listens, which the launcher (or process 0) waits for before going on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

READY = "jddp coordinator: listening on"
USAGE = (
    "usage: python -m jddp.runtime.coordinator HOST:PORT NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S [--parent PID --grace S]"
)
START_TIMEOUT_S = 60.0
STOP_SIGNAL = signal.SIGUSR1  # what ends the service that process 0 started (``start_for_parent``)


def main(argv: list[str]) -> int:
    """Hosts the service until SIGTERM or SIGINT (or its parent's death and the grace); returns the exit code."""
    parent = grace = None
    if len(argv) == 8 and argv[4] == "--parent" and argv[6] == "--grace":
        parent, grace, argv = int(argv[5]), float(argv[7]), argv[:4]
    if len(argv) != 4:
        print(USAGE, file=sys.stderr)
        return 2
    address, num_processes, heartbeat_s, shutdown_s = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    if parent is not None:  # the job's SIGTERM is for the processes, which need the service to save and stop
        for ignored in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(ignored, signal.SIG_IGN)
        stop_signals = {STOP_SIGNAL}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # taken by sigwait below
    from jddp.runtime import jax_internals

    service = jax_internals.start_coordination_service(address, num_processes, heartbeat_s, shutdown_s)
    print(f"{READY} {address} for {num_processes} processes", flush=True)
    if parent is not None and grace is not None:
        _quiet()  # process 0's output is not the place for the service's logs about lost clients
        threading.Thread(target=_outlive, args=(parent, grace), daemon=True).start()
    signal.sigwait(stop_signals)
    service.shutdown()
    return 0


def _quiet() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)


def _outlive(parent: int, grace_s: float) -> None:
    """Once ``parent`` is gone (it was process 0 and did not stop this service itself), waits ``grace_s`` for the
    survivors to notice and exit, then ends the service."""
    while os.getppid() == parent:
        time.sleep(0.5)
    time.sleep(grace_s)
    os.kill(os.getpid(), STOP_SIGNAL)


def start_for_parent(
    bind: str, num_processes: int, heartbeat_s: int, shutdown_s: int, grace_s: float
) -> subprocess.Popen[bytes]:
    """Process 0 without a launcher: starts the service as a child of this process and waits until it listens.

    Raises:
      OSError: the service did not start (with what it said).
    """
    argv = [bind, str(num_processes), str(heartbeat_s), str(shutdown_s), "--parent", str(os.getpid())]
    child = subprocess.Popen(
        [sys.executable, "-u", "-m", "jddp.runtime.coordinator", *argv, "--grace", f"{grace_s:g}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert child.stdout is not None
    said: list[bytes] = []
    ready = threading.Event()

    def read(pipe) -> None:
        for line in pipe:  # until the child's output closes (it points it at /dev/null once it listens)
            said.append(line)
            if line.startswith(READY.encode()):
                ready.set()

    threading.Thread(target=read, args=(child.stdout,), daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.wait(0.05):
        if child.poll() is not None or time.monotonic() > deadline:
            break
    if ready.is_set():
        return child
    child.kill()
    text = b"".join(said).decode(errors="replace").strip() or "no output"
    raise OSError(f"jddp.initialize: the coordination service at {bind} did not start:\n{text}")


def stop(child: subprocess.Popen[bytes]) -> None:
    """At process 0's normal exit: JAX's shutdown barrier first (every process's client leaves the service), then
    the service ends. (``os._exit`` paths skip this; the service then ends by its grace.)"""
    import jax

    try:
        jax.distributed.shutdown()
    except Exception:  # a peer that never came: the service is not needed any more either way
        pass
    if child.poll() is None:
        child.send_signal(STOP_SIGNAL)
        try:
            child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            child.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
