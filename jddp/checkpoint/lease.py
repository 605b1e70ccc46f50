"""One writer per checkpoint directory: a lease file that a second writer refuses.

Orbax assumes one writer: a second ``CheckpointManager`` opened on a directory
(an evaluator, a notebook, a relaunch beside the old run) removes the first
one's in-flight ``<step>.orbax-checkpoint-tmp`` at start-up, and the first
run's save fails. A writing ``Checkpointer`` therefore takes a lease before it
opens Orbax's manager, and readers use ``read_only=True``, which takes none.

The lease is ``<directory>/jddp.lease``, created with ``O_EXCL`` (atomic on
local file systems and on NFS v3 and later). Its content names the owner (a
random id, host, pid, the process's start time, jddp's group size, when it was
taken); its modification time is the heartbeat, refreshed by a daemon thread
every ``timeout_s / 6`` seconds. A heartbeat only touches the file, so a
writer that lost its lease never overwrites the new owner's content.

A lease is stale, and is taken over, when its owner is a process of this host
that no longer runs (pid gone, or reused by a process started at another
time), or when its heartbeat is older than ``timeout_s`` (an owner on another
host that died, or froze for that long), or when its owner was a process of an earlier attempt or elastic round of
the same launched run (the same ``JDDP_RUN_START``, an earlier ``JDDP_ATTEMPT_START``: the launchers ended that
attempt before starting this one, or its host was lost; without this, a lost node 0's lease would refuse its
successor's process 0 for ``timeout_s``). Take-over renames the stale file
aside (``rename`` is atomic: of two writers taking over at once, one renames
and the other finds no file) and creates a new one with ``O_EXCL``. A writer
whose lease was taken over (it froze past the timeout) finds out at its next
save and raises instead of writing beside the new owner.

In a group only process 0 takes the lease; the others follow its decision,
agreed by a collective in ``Checkpointer``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path

from jddp import envvars
from jddp.checkpoint.errors import CheckpointLeaseError

FILENAME = "jddp.lease"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[19]  # field 22 of stat; the first two (pid, comm) are cut off above
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return started is None or _start_time(pid) in (None, started)


def describe(owner: dict, age_s: float | None = None) -> str:
    """The owner as a user reads it: pid 1234 on host-a (since 12:03:04, heartbeat 3 s ago); a lease file that
    cannot be read (being written, or damaged) says so."""
    if not _well_formed(owner):
        text = "an owner its lease file does not name (the file is being written, or damaged)"
        return text + (f", last heartbeat {age_s:.0f} s ago" if age_s is not None else "")
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner["taken"]))
    text = f"pid {owner['pid']} on {owner['host']!r}"
    if owner.get("processes", 1) > 1:
        text += f" (process 0 of {owner['processes']})"
    text += f", since {since}"
    if age_s is not None:
        text += f", last heartbeat {age_s:.0f} s ago"
    return text


def _well_formed(owner: dict) -> bool:
    """Whether ``owner`` has the fields a lease file is written with, of their types (a read one may be damaged)."""
    return (
        isinstance(owner.get("id"), str)
        and isinstance(owner.get("host"), str)
        and type(owner.get("pid")) is int
        and owner["pid"] > 0
        and (owner.get("started") is None or isinstance(owner.get("started"), str))
        and type(owner.get("processes", 1)) is int
        and isinstance(owner.get("taken"), int | float)
        and 0 <= owner["taken"] < float("inf")
    )


class Lease:
    """The lease on ``directory``, taken by ``acquire`` and given back by ``release``."""

    def __init__(self, directory: Path, *, timeout_s: float, processes: int = 1) -> None:
        self.path = directory / FILENAME
        self.timeout_s = timeout_s
        pid = os.getpid()
        self.owner = {
            "id": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": pid,
            "started": _start_time(pid),
            "processes": processes,
            "taken": time.time(),
            # The launched run and this attempt of it (jddp launch sets both; None elsewhere): an earlier attempt's
            # lease is taken over at once (``stale_reason``).
            "run": envvars.get("JDDP_RUN_START"),
            "attempt": envvars.get("JDDP_ATTEMPT_START"),
        }
        self.lost: str | None = None  # why this lease is no longer ours, once the heartbeat finds out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- reading

    def read(self) -> tuple[dict | None, float | None]:
        """The current owner and the heartbeat's age in seconds; (None, None) without a lease file."""
        try:
            age = max(time.time() - self.path.stat().st_mtime, 0.0)
        except FileNotFoundError:
            return None, None
        try:
            owner = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):  # a directory in its place, unreadable, cut short, garbage
            owner = None
        # Being written (created, not yet filled) or damaged: judged by its heartbeat alone.
        return (owner if isinstance(owner, dict) and _well_formed(owner) else {}), age

    def stale_reason(self, owner: dict, age_s: float | None) -> str | None:
        """Why the lease of ``owner`` may be taken over, or None while it is live."""
        if owner and owner["host"] == socket.gethostname():
            if not _pid_alive(owner["pid"], owner.get("started")):
                return f"its owner, pid {owner['pid']} on this host, no longer runs"
        if age_s is not None and age_s > self.timeout_s:
            return f"its heartbeat is {age_s:.0f} s old (stale after {self.timeout_s:g} s)"
        run, attempt = self.owner["run"], self.owner["attempt"]
        theirs = owner.get("attempt") if owner else None
        if run is not None and attempt is not None and owner.get("run") == run and isinstance(theirs, int | float):
            if theirs < attempt:
                return "its owner belongs to an earlier attempt or round of this run, which the launcher ended"
        return None

    # ---------------------------------------------------------------- taking and giving back

    def acquire(self) -> None:
        """Takes the lease, taking over a stale one; raises ``CheckpointLeaseError`` while another holds it."""
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner, age = self.read()
                if owner is None:
                    continue  # released meanwhile
                reason = self.stale_reason(owner, age)
                if reason is None:
                    raise CheckpointLeaseError(self._refusal(owner, age)) from None
                aside = self.path.with_name(f"{FILENAME}.stale-{self.owner['id']}")
                try:
                    os.rename(self.path, aside)  # atomic: of two writers taking over, one wins
                except FileNotFoundError:
                    continue
                if aside.is_dir() and not aside.is_symlink():  # a directory in the lease's place
                    shutil.rmtree(aside, ignore_errors=True)
                else:
                    aside.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
                f.flush()
                os.fsync(f.fileno())
            self._thread = threading.Thread(target=self._beat, name="jddp-checkpoint-lease", daemon=True)
            self._thread.start()
            return
        raise CheckpointLeaseError(
            f"Could not take the lease {self.path}: other writers keep taking it. Run one writer per directory."
        )

    def _refusal(self, owner: dict, age_s: float | None) -> str:
        directory = self.path.parent
        return (
            f"Checkpoint directory {str(directory)!r} is being written by another run: {describe(owner, age_s)}. "
            "Two writers on one directory delete each other's checkpoints. To read its checkpoints while it "
            f"trains, open it with jddp.Checkpointer({str(directory)!r}, read_only=True); to write, stop that run "
            f"or choose another directory. If no run owns it any more, its lease file {str(self.path)!r} becomes "
            f"stale {self.timeout_s:g} s after its last heartbeat, or delete it."
        )

    def check(self) -> None:
        """Raises ``CheckpointLeaseError`` if another writer has taken this lease over."""
        if self.lost is None:
            owner, age = self.read()
            if owner is None or owner.get("id") != self.owner["id"]:
                self.lost = "its lease file is gone" if owner is None else f"it is now held by {describe(owner, age)}"
        if self.lost is not None:
            raise CheckpointLeaseError(
                f"This run no longer holds the lease on checkpoint directory {str(self.path.parent)!r}: "
                f"{self.lost}. Its heartbeat stopped for longer than {self.timeout_s:g} s (the process was "
                "stopped or frozen) and another writer took over. Nothing more is saved by this run; stop one "
                "of the two runs."
            )

    def _beat(self) -> None:
        while not self._stop.wait(self.timeout_s / 6):
            owner, _ = self.read()
            if owner is None or owner.get("id") != self.owner["id"]:
                self.lost = "its lease file is gone" if owner is None else f"it is now held by {describe(owner)}"
                return
            try:
                os.utime(self.path)
            except OSError:
                pass  # a transient failure; a lasting one shows as a stale heartbeat to others

    def release(self) -> None:
        """Gives the lease back (deletes the file if it is still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            owner, _ = self.read()
            if owner is not None and owner.get("id") == self.owner["id"]:
                self.path.unlink(missing_ok=True)


# ---------------------------------------------------------------- in a group


def take(directory, timeout_s: float) -> Lease | None:
    """Process 0 takes ``directory``'s lease; every process learns the outcome (one all-gather in a group).

    Returns the lease on process 0, None elsewhere and for remote directories (``gs://``, ``s3://``: an object
    store has no atomic create through Orbax's paths, so one writer per directory is the user's to keep there).
    """
    import jax

    from jddp.checkpoint import preemption, storage

    held, refusal = None, None
    if jax.process_index() == 0 and not storage.is_remote(directory):
        held = Lease(Path(directory), timeout_s=timeout_s, processes=jax.process_count())
        try:
            held.acquire()
        except CheckpointLeaseError as error:
            held, refusal = None, error
        except OSError as error:  # the lease is process 0's first write in the directory
            held, refusal = None, storage.not_writable(directory, error)
    if not preemption.all_agree(refusal is None):
        if held is not None:
            held.release()
        raise refusal or CheckpointLeaseError(
            f"Checkpoint directory {str(directory)!r} is being written by another run (process 0 found its "
            "lease; its error says which run). Open it with read_only=True to read it, or choose another directory."
        )
    return held


def check_held(held: Lease | None, directory) -> None:
    """Raises ``CheckpointLeaseError`` on every process if process 0's lease was taken over (agreed)."""
    from jddp.checkpoint import preemption

    error = None
    if held is not None:
        try:
            held.check()
        except CheckpointLeaseError as lost:
            error = lost
    if not preemption.all_agree(error is None):
        raise error or CheckpointLeaseError(
            f"Process 0 no longer holds the lease on checkpoint directory {str(directory)!r}: another writer took "
            "it over (process 0's error says which). Nothing more is saved by this run."
        )
