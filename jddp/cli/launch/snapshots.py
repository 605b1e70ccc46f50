"""The run's snapshot directory (``JDDP_SNAPSHOT_DIR``): made in memory by each launcher and locked while it runs,
and the sweep of those left by launchers that no longer run."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable

SNAPSHOT_PREFIX = "jddp-snapshots-"  # the launcher's snapshot directory: jddp-snapshots-<launcher pid>-<random>
SNAPSHOT_LOCK = ".launcher.lock"  # in it: flocked by its launcher while it runs (sweep_snapshots)


class SnapshotDir:
    """The run's snapshot directory: the user's when set (kept), else one made here and removed at ``close``."""

    def __init__(self) -> None:
        self.path: str | None = None  # JDDP_SNAPSHOT_DIR, set by open()
        self.own = False
        self.lock: int | None = None  # the flock held on the directory's lock file (make_locked_dir)

    def open(self, user_dir: str | None, say: Callable[[str], None]) -> None:
        """The user's directory when set, else one in memory made here; leftovers of launchers of this host that no
        longer run are removed first."""
        if user_dir is not None:
            self.path = user_dir
            return
        base = snapshot_base()
        for path in sweep_snapshots(base):
            say(f"removed {path}, the snapshot directory of a launcher that no longer runs")
        self.path, self.lock = make_locked_dir(base)
        self.own = True

    def close(self) -> None:
        """Removes the directory made here (not the user's) and drops its lock."""
        if self.own and self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self.lock is not None:
            os.close(self.lock)


def snapshot_base() -> str:
    """Where the launcher makes its snapshot directory: ``/dev/shm`` when it is a tmpfs (memory), else the temporary
    directory."""
    with contextlib.suppress(OSError):
        with open("/proc/self/mounts") as f:
            if any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in f):
                return "/dev/shm"
    return tempfile.gettempdir()


def make_locked_dir(base: str) -> tuple[str, int]:
    """A new snapshot directory in ``base``, ``jddp-snapshots-<pid>-<random>``, and the descriptor of its
    ``SNAPSHOT_LOCK`` file, on which this process holds an exclusive ``flock`` until it ends (the kernel drops it
    when the process dies, SIGKILL included). The directory is made and locked under a name ``sweep_snapshots``
    ignores, then renamed: it is never seen unlocked."""
    hidden = tempfile.mkdtemp(prefix=f".{SNAPSHOT_PREFIX}{os.getpid()}-", dir=base)
    fd = os.open(os.path.join(hidden, SNAPSHOT_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    path = os.path.join(base, os.path.basename(hidden)[1:])
    os.rename(hidden, path)
    return path, fd


def sweep_snapshots(base: str) -> list[str]:
    """Removes the snapshot directories in ``base`` of launchers that no longer run (one SIGKILLed cannot remove its
    own); returns them. A directory's launcher runs while it holds the ``flock`` of its ``SNAPSHOT_LOCK`` file: that
    holds across PID namespaces (containers sharing ``/dev/shm``), where a pid says nothing. Those of running
    launchers, and of other users' (not ours to lock), stay. A directory without the lock file (a launcher of an
    older jddp) is judged by its pid, as before."""
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            pid = name[len(SNAPSHOT_PREFIX) :].split("-", 1)[0]
            if not name.startswith(SNAPSHOT_PREFIX) or not pid.isdigit():
                continue
            path = os.path.join(base, name)
            try:
                fd = os.open(os.path.join(path, SNAPSHOT_LOCK), os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = None
            except OSError:
                continue  # another user's, or going away
            try:
                if fd is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError:
                        continue  # its launcher runs
                elif int(pid) == os.getpid() or _pid_runs(int(pid)):
                    continue
                shutil.rmtree(path, ignore_errors=True)
            finally:
                if fd is not None:
                    os.close(fd)
            if not os.path.exists(path):
                removed.append(path)
    return removed


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process runs under that pid
    return True
