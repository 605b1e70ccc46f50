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
watchdogs find it silent and exit 69 naming it. Runs started without the
launcher (SLURM's ``srun``, a hand-written script) keep JAX's default.

The service runs until SIGTERM or SIGINT. It prints one line when it listens,
which the launcher waits for before starting the processes.
"""

from __future__ import annotations

import signal
import sys

READY = "jddp coordinator: listening on"
USAGE = "usage: python -m jddp.runtime.coordinator HOST:PORT NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S"


def main(argv: list[str]) -> int:
    """Hosts the service until SIGTERM or SIGINT; returns the exit code."""
    if len(argv) != 4:
        print(USAGE, file=sys.stderr)
        return 2
    address, num_processes, heartbeat_s, shutdown_s = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})  # taken by sigwait below
    from jddp.runtime import jax_internals

    service = jax_internals.start_coordination_service(address, num_processes, heartbeat_s, shutdown_s)
    print(f"{READY} {address} for {num_processes} processes", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    service.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
