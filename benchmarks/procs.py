"""Processes around the benchmarks' groups: a launcher's children and workers, busy processes loading the cores."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def children(pid: int) -> list[int]:
    """The process ``pid``'s children (Linux ``/proc``), or ``[]`` once it is gone."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def descendants(pid: int) -> set[int]:
    """The process ``pid``'s children, theirs, and so on (spares forked by the launcher's zygote are its
    grandchildren)."""
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def workers(launcher: int) -> list[int]:
    """The launcher's Python worker processes (not the coordination service), in start order."""
    out = []
    for pid in children(launcher):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"train.py") for part in cmd):
            out.append(pid)
    return out


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` busy Python processes (``while True: pass``) beside whatever runs inside, killed and reaped after."""
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in load:
            p.kill()
            p.wait()
