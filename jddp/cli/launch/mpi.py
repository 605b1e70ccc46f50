"""``--transport mpi``: the group as one ``mpiexec -n N`` per attempt, under the mpich wheel's ``mpiexec``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from jddp import exitcodes
from jddp.cli import output
from jddp.cli.launch import config as config_lib
from jddp.cli.launch import environment, workers


def mpi_environment(config: config_lib.LaunchConfig, attempt: int) -> dict[str, str]:
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
        env["GLIBC_TUNABLES"] = environment.MALLOC_TUNABLES
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


def run_mpi(
    config: config_lib.LaunchConfig,
    out: output.Output,
    group: workers.WorkerGroup,
    snapshot_dir: str | None,
    signal_received: Callable[[], int | None],
) -> int:
    """Runs the group as one ``mpiexec -n N`` per attempt: MPI's process manager (hydra) starts the processes,
    prefixes their lines with their rank and ends the group when one is killed (naming its pid and signal); a
    process that exits early is named by the others' watchdogs (exit 69), as under the gloo transport."""
    c = config
    try:
        mpiexec = find_mpiexec()
    except FileNotFoundError as error:
        out.say(str(error))
        return 1
    for attempt in range(c.max_restarts + 1):
        # Not `python -u`: unbuffered, print() writes a line and its end apart, and mpiexec prefixes
        # each write with the rank; jddp.initialize() makes the streams line-buffered instead.
        argv = [mpiexec, "-n", str(c.nprocs), "-prepend-rank", *(a for a in config_lib.command(c) if a != "-u")]
        env = mpi_environment(c, attempt)
        if snapshot_dir is not None:
            env[environment.ENV_SNAPSHOT_DIR] = snapshot_dir
        popen = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        worker = workers.Worker(0, popen)
        group.workers = [worker]
        for pipe, target, native in ((popen.stdout, sys.stdout, True), (popen.stderr, sys.stderr, False)):
            reader = threading.Thread(target=out.pump, args=(pipe, target, b""), kwargs={"native": native}, daemon=True)
            reader.start()
            worker.readers.append(reader)
        out.say(
            f"started {c.nprocs} processes under {mpiexec} (attempt {attempt + 1} of {c.max_restarts + 1}, "
            f"transport mpi): {' '.join(argv[4:])}"
        )
        while popen.poll() is None and signal_received() is None:
            time.sleep(c.monitor_interval)
        received = signal_received()
        if received is not None:
            group.stop_after_signal(received, c.term_timeout)
            code = popen.returncode
            return exitcodes.EXIT_PREEMPTED if code == exitcodes.EXIT_PREEMPTED else 128 + received
        group.finish_output()
        code = popen.returncode
        if code in (0, exitcodes.EXIT_PREEMPTED):
            return code
        what = exitcodes.describe(code)
        if attempt < c.max_restarts:
            restarts = f"{attempt + 1} of {c.max_restarts}"
            out.say(f"the group under mpiexec {what}; restarting it ({restarts})")
            continue
        out.say(f"the group under mpiexec {what}; no restart left (--max-restarts {c.max_restarts})")
        return 128 - code if code < 0 else code
    raise AssertionError("unreachable: the last attempt returns")
