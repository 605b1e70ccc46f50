"""The zygote: one process per node that imports what a spare imports (``jddp.cli.spare.HEAVY_MODULES``) once, then
forks a spare whenever the launcher asks, already imported, in about 10 ms.

A spare started as a process of its own spends 1.4 to 1.9 s in Python's start and its imports (2-core x86-64 VM,
29 Nov 2026); a failure within a second of a restart found the next attempt's spares still importing, or none, and
its processes then took 2.2 to 4.1 s from the kill to their first step (``benchmarks/chaos.py``). A fork of an
imported process has those imports done: it is a spare from its first instant.

Protocol, on the socket ``FD`` (``python -u -m jddp.cli.zygote FD``, started by ``jddp.cli.launch.zygote``):

- the zygote sends ``READY`` once its imports are done;
- a request is one message of JSON (``{"cores": [...] | null}``) carrying four descriptors (``SCM_RIGHTS``): the
  spare's end of its socket with the launcher, and the write ends of the pipes for its fd 1, its fd 2 and Python's
  stdout (``JDDP_STDOUT_FD``);
- the zygote answers ``{"forked": PID, "stdout_fd": N}`` (N: the number Python's stdout pipe has in the spare) and,
  when that spare ends, ``{"exited": PID, "code": C}`` (C as ``subprocess.Popen.returncode``: minus the signal's
  number for a signal). The zygote is the spare's parent: only it can reap the spare and know its exit code.

The forked spare starts a session of its own (as every process the launcher starts: its own autogroup, signalled as
a group, ended by ``jddp.cli.launch.orphans``), pins itself to its cores, points fd 1 and 2 at its pipes, and is
then a spare as ``python -m jddp.cli.spare`` is (``jddp.cli.spare.serve``). Nothing that depends on a role happens in
the zygote either: its imports start no JAX backend. What a fork shares with its zygote and a fresh process would
not: NumPy's global random state (reseeded in the spare from the OS, as Python's ``random`` reseeds itself at every
fork) and the hash seed of ``str`` (fixed per interpreter; nothing of a run depends on it). The zygote exits when the
launcher's end of ``FD`` closes, or on SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import warnings

from jddp.cli import spare as spare_lib
from jddp.handoff import READY

__all__ = ["main"]

MAX_REQUEST = 4096


def _child(channel_fd: int, out_fd: int, err_fd: int, cores: list[int] | None, closed: list[int], started: int) -> int:
    """In the forked spare: its own session (said on ``started`` once made), cores and output, then a spare's life
    (returns its exit code)."""
    signal.set_wakeup_fd(-1)
    for fd in closed:  # the zygote's own: its socket with the launcher (detached), its pipes
        with contextlib.suppress(OSError):
            os.close(fd)
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    os.setsid()  # before the launcher hears of it: it signals the session, never the pid alone
    os.write(started, b"s")
    os.close(started)
    if cores:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in (out_fd, err_fd):
        if fd > 2:
            os.close(fd)
    if "numpy" in sys.modules:  # Python's random reseeds itself in a fork; NumPy's global state does not
        sys.modules["numpy"].random.seed()
    return spare_lib.serve(socket.socket(fileno=channel_fd))


def _send(control: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        control.sendall(json.dumps(message).encode() + b"\n")


def serve(control: socket.socket) -> int | None:
    """Forks spares on request until the launcher closes ``control``; returns None in the zygote (it ends), or the
    exit code of a forked spare's life (in that spare)."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_write)
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([control, wake_read], [], [])
        if wake_read in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_read, 4096)
        for pid in list(children):  # reap: each ended spare's code goes to the launcher
            with contextlib.suppress(ChildProcessError):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    children.discard(pid)
                    _send(control, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if control not in readable:
            continue
        try:
            message, fds, _, _ = socket.recv_fds(control, MAX_REQUEST, 4)
        except OSError:
            return None
        if not message:  # the launcher is gone, or needs no more spares
            return None
        if len(fds) != 4:
            for fd in fds:
                os.close(fd)
            continue
        request = json.loads(message)
        channel_fd, out_fd, err_fd, stdout_fd = fds
        started_read, started_write = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns at a fork of a process with several threads: the zygote has one native thread
            # besides its main one, started by its imports and idle once they are done (what a fork of it may not
            # rely on is in this module's docstring; the tests fork and run whole training attempts)
            warnings.filterwarnings("ignore", r".*use of fork\(\) may lead to deadlocks", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            # detached, not closed: the socket object, still referenced here, would close its number again when
            # collected, by then another descriptor's (gRPC's epoll one: "epoll_wait error: Bad file descriptor")
            closed = [control.detach(), wake_read, wake_write, started_read]
            return _child(channel_fd, out_fd, err_fd, request.get("cores"), closed, started_write)
        children.add(pid)
        os.close(started_write)
        with contextlib.suppress(OSError):
            os.read(started_read, 1)  # its session exists (or it died: its end is reported as any spare's)
        os.close(started_read)
        for fd in fds:
            os.close(fd)
        _send(control, {"forked": pid, "stdout_fd": stdout_fd})


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m jddp.cli.zygote FD (started by jddp launch)", file=sys.stderr)
        return 2
    control = socket.socket(fileno=int(argv[0]))
    spare_lib.prepare()
    with contextlib.suppress(OSError):
        control.sendall(READY)
    code = serve(control)
    if code is None:  # the zygote itself
        control.close()
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
