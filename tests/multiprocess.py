"""Runs worker scripts as several real JAX processes on 127.0.0.1 (never in pytest's own process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from jddp import net

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def environment(**extra: str) -> dict[str, str]:
    """This environment for a worker: the repository importable, no inherited device flags."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **extra}
    env.pop("XLA_FLAGS", None)
    for name in ("JDDP_COORDINATOR", "JDDP_NUM_PROCESSES", "JDDP_PROCESS_ID", "JDDP_LOCAL_DEVICES"):
        if name not in extra:
            env.pop(name, None)
    return env


def spawn_slurm(
    script: str, nprocs: int, devices_per_process: int, *args: str, **extra_env: str
) -> list[subprocess.Popen]:
    """Starts ``script`` as ``nprocs`` processes with the variables SLURM's ``srun`` sets (one node, 127.0.0.1),
    and no ``JDDP_*`` group variables: ``jddp.initialize`` finds the group as JAX's cluster detection does."""
    port = net.free_port()

    def slurm(i: int) -> dict[str, str]:
        return {
            "SLURM_JOB_ID": "4242",
            "SLURM_STEP_NODELIST": "127.0.0.1",
            "SLURM_NTASKS": str(nprocs),
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": str(i),
            "JAX_COORDINATOR_PORT": str(port),
        }

    return _start(script, args, [slurm(i) for i in range(nprocs)], devices_per_process, extra_env)


def spawn(script: str, nprocs: int, devices_per_process: int, *args: str, **extra_env: str) -> list[subprocess.Popen]:
    """Starts ``script`` as ``nprocs`` processes of one group, without the launcher.

    Each process gets ``JDDP_COORDINATOR``, ``JDDP_NUM_PROCESSES``,
    ``JDDP_PROCESS_ID`` and ``JDDP_LOCAL_DEVICES``, as ``jddp launch`` would set them.
    """
    port = net.free_port()
    group = [
        {"JDDP_COORDINATOR": f"127.0.0.1:{port}", "JDDP_NUM_PROCESSES": str(nprocs), "JDDP_PROCESS_ID": str(i)}
        for i in range(nprocs)
    ]
    return _start(script, args, group, devices_per_process, extra_env)


def _start(script: str, args, envs: list[dict[str, str]], devices: int, extra_env) -> list[subprocess.Popen]:
    """One process of ``script`` per entry of ``envs`` (its group variables), output collected."""
    return [
        subprocess.Popen(
            [sys.executable, script, *args],
            env=environment(**env, JDDP_LOCAL_DEVICES=str(devices), **extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for env in envs
    ]


def collect(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int | str], list[str]]:
    """Waits for every process; returns their exit codes ("timeout" for one killed at the deadline) and outputs."""
    outputs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append(out)
            codes.append(p.returncode)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
        codes = ["timeout"] * len(procs)
    return codes, outputs


def show(codes, outputs) -> str:
    return "\n".join(
        f"--- process {i} (exit {c}) ---\n{o}" for i, (c, o) in enumerate(zip(codes, outputs, strict=True))
    )


def run(script: str, nprocs: int, devices_per_process: int, *args: str, timeout: float = 180) -> list[str]:
    """Runs ``script`` as ``nprocs`` processes; returns their outputs or fails showing all of them."""
    codes, outputs = collect(spawn(script, nprocs, devices_per_process, *args), timeout)
    if any(c != 0 for c in codes):
        raise AssertionError(f"{script} failed:\n{show(codes, outputs)}")
    return outputs


def launch(*argv: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs ``python -m jddp.launch *argv`` and returns its result (stdout and stderr kept apart)."""
    return subprocess.run(
        [sys.executable, "-m", "jddp.launch", *argv],
        env=environment(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def wait_read(launcher: subprocess.Popen, readers: list, timeout: float) -> None:
    """Waits for ``launcher`` (killed at ``timeout`` or on an error), then for the threads that read its pipes, and
    closes the pipes."""
    for reader in readers:
        reader.start()
    try:
        launcher.wait(timeout=timeout)
    finally:
        launcher.kill()
        for reader in readers:
            reader.join(10)
        for pipe in (launcher.stdout, launcher.stderr):
            assert pipe is not None
            pipe.close()


def descendants(pid: int) -> set[int]:
    """``pid``'s children, theirs, and so on (``/proc/<pid>/task/*/children``)."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += list(children - found)
            found |= children
    return found


def ipv6_loopback() -> bool:
    """Whether this machine can listen on ``::1``."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False
