"""No orphans: a launcher's processes end within a second of the launcher's death, however it dies (SIGKILL too).

What a launcher starts (its workers, spares, standby processes and the coordination service it hosts) runs in
sessions of their own, so that a terminal's Ctrl-C reaches the launcher only. When the launcher itself dies without
ending them (SIGKILL, the OOM killer, a crash), nothing else would: a worker's watchdog notices its parent gone only
after ``jddp.initialize`` and a watchdog round, a spare only when it reads its socket, the service after its grace;
node 0's orphans of an elastic run went on for 11 to 16 s.

The mechanism: at its first start of a process, the launcher starts a watcher, ``python -I -S orphans.py FD``, that
holds the read end of a pipe whose only write end the launcher holds (not inherited by anything it starts). The
launcher writes ``+PID`` for every session it starts (``watch``). The kernel closes the write end when the launcher
exits, however it exits; the watcher then reads end-of-file and sends ``FLUSH_SIGNAL`` to every session still alive
(a worker flushes its files and exits: ``jddp.runtime.flush``; a spare or the service ends by the signal's default
action), ``SIGKILL`` ``GRACE_S`` later to what is left, and exits. A launcher that ended its processes itself finds
none left there.

Why not ``prctl(PR_SET_PDEATHSIG)``: it fires when the *thread* that forked the child exits, not the process (a
spawn from a short-lived thread would kill its child early), it covers the direct child only (a worker's Grain
processes, a process's own coordination service are not), and it needs code between ``fork`` and ``exec``
(``preexec_fn``, unsafe in a threaded launcher). The pipe covers whole sessions, and which thread started a process
does not matter: the watcher sees the process's end, not a thread's.

The watcher imports only the standard library (it runs as a file, not through ``jddp``'s package: no JAX, started in
about 20 ms), ignores SIGINT, SIGTERM and SIGHUP (a job's signals are the launcher's to forward), and forgets a
session once its leader ended and no process is left in it (the PID may be reused later). Its own death (SIGKILL)
leaves the launcher's processes as before: the workers' watchdogs still notice the launcher gone.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

FLUSH_SIGNAL = signal.SIGUSR2  # jddp.runtime.flush.FLUSH_SIGNAL (this file imports nothing of jddp)
GRACE_S = 0.5  # between FLUSH_SIGNAL and SIGKILL: the orphans end within a second of the launcher's death
SWEEP_S = 1.0  # how often the watcher forgets sessions that ended


class _Watch:
    """The launcher's side: the watcher process and the write end of its pipe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.write_fd: int | None = None
        self.watcher: subprocess.Popen[bytes] | None = None
        self.folders: list[str] = []  # the launcher's temporary folders, removed by the watcher at its death

    def start(self) -> None:
        read_fd, write_fd = os.pipe()  # neither end inherited by what the launcher starts later (PEP 446)
        try:
            self.watcher = subprocess.Popen(
                [sys.executable, "-I", "-S", os.path.abspath(__file__), str(read_fd)],
                pass_fds=(read_fd,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C is the launcher's to forward
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self.write_fd = write_fd
        for folder in self.folders:
            os.write(write_fd, f"d{folder}\n".encode())

    def add(self, pid: int) -> None:
        with self.lock:
            if self.write_fd is None:
                self.start()
            assert self.write_fd is not None
            os.write(self.write_fd, f"+{pid}\n".encode())


_WATCH = _Watch()


def remove_at_death(folder: str) -> None:
    """Removes the launcher's temporary ``folder`` (a ``jddp-launch-*`` one) after its processes were ended at the
    launcher's death (their notes and snapshots: nobody else removes it then). Starts no process: told to the
    watcher when the first ``watch`` starts it."""
    with _WATCH.lock:
        _WATCH.folders.append(folder)
        if _WATCH.write_fd is not None:
            os.write(_WATCH.write_fd, f"d{folder}\n".encode())


def watch(pid: int) -> None:
    """Ends the session of process ``pid`` (one started with ``start_new_session=True``) when this launcher dies.

    Call it right after the process starts, from any thread. The first call starts the watcher process.
    """
    _WATCH.add(pid)


def watcher_pid() -> int | None:
    """The watcher's process id, once a first ``watch`` started it (for tests)."""
    return _WATCH.watcher.pid if _WATCH.watcher is not None else None


# -- the watcher (run as a file: ``python -I -S orphans.py FD``) --------------------------------------------------
def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the group's id: not ours
        return False


def _signal_groups(pgids: set[int], signum: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _sweep(sessions: dict[int, int | None]) -> None:
    """Forgets the sessions whose leader ended and that hold no process any more."""
    for pid, pidfd in list(sessions.items()):
        ended = pidfd is None or bool(select.select([pidfd], [], [], 0)[0])
        if ended and not _group_alive(pid):
            if pidfd is not None:
                os.close(pidfd)
            del sessions[pid]


def _end_all(sessions: dict[int, int | None], grace_s: float) -> None:
    """The launcher is gone: FLUSH_SIGNAL to every session left, SIGKILL ``grace_s`` later to those still alive."""
    alive = {pid for pid in sessions if _group_alive(pid)}
    _signal_groups(alive, FLUSH_SIGNAL)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = {pid for pid in alive if _group_alive(pid)}
    _signal_groups(alive, signal.SIGKILL)


def serve(read_fd: int, grace_s: float = GRACE_S) -> None:
    """The watcher's loop: registers ``+PID`` lines from ``read_fd`` until end-of-file, then ends every session."""
    sessions: dict[int, int | None] = {}  # session leader's pid -> its pidfd (None where pidfds are missing)
    folders: list[str] = []  # the launcher's temporary folders, removed once its sessions ended
    pending = b""
    last_sweep = time.monotonic()
    while True:
        readable, _, _ = select.select([read_fd], [], [], SWEEP_S)
        if readable:
            data = os.read(read_fd, 65536)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if line.startswith(b"d") and os.path.basename(line[1:].decode(errors="replace")).startswith(
                    "jddp-launch-"
                ):
                    folders.append(line[1:].decode(errors="replace"))
                    continue
                if line.startswith(b"+") and line[1:].isdigit():
                    pid = int(line[1:])
                    try:
                        sessions[pid] = os.pidfd_open(pid)
                    except ProcessLookupError:  # ended and reaped already: nothing to end
                        continue
                    except (AttributeError, OSError):
                        sessions[pid] = None
        if time.monotonic() - last_sweep >= SWEEP_S:
            _sweep(sessions)
            last_sweep = time.monotonic()
    _end_all(sessions, grace_s)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -I -S orphans.py FD (started by jddp launch)", file=sys.stderr)
        return 2
    for ignored in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(ignored, signal.SIG_IGN)
    serve(int(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
