"""The checkpoint directory: its path (local, or remote through Orbax), whether it can be written, and the
messages and logs of a write that failed."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import jax


def is_remote(path) -> bool:
    return "://" in str(path)


def resolve(directory):
    """A local path made absolute, or a remote one (``gs://``, ``s3://``) as Orbax's own ``etils.epath.Path``."""
    if isinstance(directory, str | os.PathLike) and is_remote(os.fspath(directory)):
        from etils import epath

        return epath.Path(os.fspath(directory))
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"`directory` must be a path (str or os.PathLike), got {type(directory).__name__}: {directory!r}."
        )
    if os.fspath(directory) == "":
        raise ValueError("`directory` is empty. Pass the checkpoint directory, e.g. 'runs/exp1/ckpt'.")
    return Path(directory).absolute()


class OrbaxErrorLogs(logging.Filter):
    """While a Checkpointer is open, Orbax's ERROR logs (with tracebacks, one per thread a failed write passed
    through) are dropped: the failure reaches the caller once, as a ``CheckpointError`` with Orbax's error as
    its cause. So is its warning that a read-only directory is read-only. Orbax's other warnings and other
    libraries' logs pass."""

    users = 0
    instance: OrbaxErrorLogs | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" not in record.pathname:
            return True
        return record.levelno < logging.ERROR and not str(record.msg).startswith("Given directory is read only")

    @classmethod
    def hold(cls) -> None:
        if cls.users == 0:
            cls.instance = cls()
            logging.getLogger("absl").addFilter(cls.instance)
        cls.users += 1

    @classmethod
    def release(cls) -> None:
        cls.users -= 1
        if cls.users == 0 and cls.instance is not None:
            logging.getLogger("absl").removeFilter(cls.instance)
            cls.instance = None


def check_writable(directory, *, probe: bool = True) -> None:
    """Creates a local ``directory`` and, with ``probe``, writes a probe file in it; raises a clear error where
    it cannot. Process 0 of a writer skips the probe: taking the lease is its first write (a refused writer then
    changes nothing, not even the directory's modification time)."""
    if is_remote(directory):
        return  # Orbax's own path handling (etils.epath) reports a bad bucket or path at its first use
    for path in (directory, *directory.parents):
        if path.exists() and not path.is_dir():
            which = "is a file" if path == directory else f"is inside {str(path)!r}, which is a file"
            raise NotADirectoryError(
                f"Checkpoint directory {str(directory)!r} {which}. Pass a directory path (it is created if missing)."
            )
        if path.exists():
            break
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if probe:
            name = directory / f".jddp-write-probe-{jax.process_index()}-{os.getpid()}"
            name.write_bytes(b"ok")
            name.unlink()
    except OSError as error:
        raise not_writable(directory, error) from None


def not_writable(directory, error: OSError) -> PermissionError:
    return PermissionError(
        f"Checkpoint directory {str(directory)!r} is not writable by process {jax.process_index()} "
        f"({error.strerror or error}). Choose a directory this user can write (on a file system every "
        "process sees), or fix its permissions."
    )


def write_failure(directory, failed: list[int], published: list[int], error: Exception) -> str:
    """The message of a failed write: the steps lost, Orbax's cause, what is intact and what to do."""
    text = " ".join(str(error).split())
    full = (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "no space left" in text.lower()
    if len(text) > 400:  # Orbax's messages name every layer; the cause (e.g. the OS error) is at the end
        text = f"{text[:150]} ... {text[-250:]}"
    what = " and ".join(f"step {s}" for s in failed) if failed else "a checkpoint"
    done = sorted(s for s in published if s not in failed)
    kept = f"the newest complete checkpoint, step {done[-1]}, is intact" if done else "no earlier checkpoint exists"
    fix = (
        "The disk is full: free space there (a smaller max_to_keep keeps fewer steps) or choose another directory"
        if full
        else "Check that the directory is writable and has space"
    )
    return (
        f"Writing {what} to checkpoint directory {str(directory)!r} failed ({type(error).__name__}: {text}). "
        f"{fix}; {kept}, and the next save writes the current step again."
    )


def finish_cleanup(manager) -> None:
    """Waits for the clean-up of unfinished ``*.orbax-checkpoint-tmp`` directories that a new Orbax
    ``CheckpointManager`` starts in the background, before anything is saved.

    Orbax awaits it only at the first save, and raises there whatever it hit. Two managers opened one after the
    other on a directory (a Checkpointer reopened after a failed write, then a new one) clean the same leftover,
    and the second ``rmtree`` then finds it gone: a ``FileNotFoundError`` that failed an unrelated later save
    (seen once in five loaded runs of the disk-full test). The leftover being gone is what the clean-up wants.
    """
    pending = getattr(manager, "_cleanup_tmp_directory_future", None)  # Orbax 0.12's; absent elsewhere: no wait
    if pending is None:
        return
    try:
        pending.result()
    except FileNotFoundError:
        pass
    manager._cleanup_tmp_directory_future = None
