"""Runs a worker script in several real JAX processes on 127.0.0.1 (never in pytest's own process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, nprocs: int, devices_per_process: int, *args: str, timeout: float = 180) -> list[str]:
    """Runs ``script`` as ``nprocs`` processes; returns their outputs or fails showing all of them.

    Each process gets ``JDDP_COORDINATOR``, ``JDDP_NUM_PROCESSES``,
    ``JDDP_PROCESS_ID`` and ``JDDP_LOCAL_DEVICES``.
    """
    port = free_port()
    procs = []
    for i in range(nprocs):
        env = {
            **os.environ,
            "JDDP_COORDINATOR": f"127.0.0.1:{port}",
            "JDDP_NUM_PROCESSES": str(nprocs),
            "JDDP_PROCESS_ID": str(i),
            "JDDP_LOCAL_DEVICES": str(devices_per_process),
            "PYTHONPATH": str(ROOT),
        }
        env.pop("XLA_FLAGS", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
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
        codes = ["timeout"] * nprocs
    if any(c != 0 for c in codes):
        pairs = enumerate(zip(codes, outputs, strict=True))
        shown = "\n".join(f"--- process {i} (exit {c}) ---\n{o}" for i, (c, o) in pairs)
        raise AssertionError(f"{script} failed:\n{shown}")
    return outputs
