"""The checkpoint directory: its path (local, or remote through Orbax), whether it can be written, the
messages and logs of a write that failed, and a reference leak of TensorStore's (under Orbax) plugged.

**The leak.** TensorStore turns JSON into Python objects in one C++ function (``JsonToPyObject`` in
``python/tensorstore/json_type_caster.cc``) that hands each key and value of every JSON object to
``PyDict_SetItem`` after releasing its own reference, but ``PyDict_SetItem`` takes a reference of its own: every
key and every value of every dict it builds keeps one reference too many and is never freed, with everything
inside it. Seen in tensorstore 0.1.86. Orbax calls two such functions at every save: the metrics
(``experimental_collect_matching_metrics``, twice, for its raw-bytes throughput log) and a ``KvStore.Spec``'s
``to_json`` (once per array); a run saving every 10 steps grew by 2 to 3 MB per 1000 steps on each process.
Importing this module wraps those functions (and ``Spec.to_json``, which a restore calls) so that each drops the
extra references of what it returns, only where a probe measures exactly one extra reference: a TensorStore
without the bug is left alone. ``tests/test_leaks.py`` checks it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import re
import sys
from pathlib import Path

import jax

from jddp.runtime import watchdog


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


def nothing_to_read(directory) -> str:
    """A reader's message for a directory that holds no checkpoint: missing (with close names beside it: a typo?)
    or empty."""
    if is_remote(directory):
        return f"Checkpoint directory {str(directory)!r} holds no checkpoint: the state passed in is returned."
    if directory.exists():
        return (
            f"Checkpoint directory {str(directory)!r} holds no checkpoint (yet): the state passed in is returned "
            "untrained. Is the trainer's first save still to come, or is this another run's directory?"
        )
    import difflib

    parent = next((p for p in directory.parents if p.is_dir()), None)
    near = []
    if parent is not None and parent == directory.parent:
        near = difflib.get_close_matches(directory.name, [p.name for p in parent.iterdir() if p.is_dir()], n=3)
    hint = f" Directories of close names there: {', '.join(map(repr, near))}." if near else ""
    return (
        f"Checkpoint directory {str(directory)!r} does not exist: the state passed in is returned untrained. "
        f"Check the path (a typo?).{hint}"
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
    barrier = failed_barrier(error)
    if full:
        fix = "The disk is full: free space there (a smaller max_to_keep keeps fewer steps) or choose another directory"
    elif barrier is not None:
        fix = (
            f"The save's barrier between the processes failed, not the directory: Orbax's key-value barrier "
            f"`{barrier}`. A peer process was lost or slower than the Checkpointer's timeout_s (the watchdog names "
            "a lost one), or two saves of this process waited at one barrier (Orbax names barriers by what they "
            "do; jddp gives each Checkpointer its own prefix, so report it if a jddp Checkpointer did this)"
        )
    elif watchdog.is_collective_failure(error):  # the save's exchange between processes, not the disk
        fix = (
            "A collective of the save failed: a peer process is lost or cut off (the watchdog names it), not the "
            "directory"
        )
    else:
        fix = "Check that the directory is writable and has space"
    return (
        f"Writing {what} to checkpoint directory {str(directory)!r} failed ({type(error).__name__}: {text}). "
        f"{fix}; {kept}, and the next save writes the current step again."
    )


# The coordination service's words for a failed barrier (jaxlib's coordination_service.cc): a timeout, a barrier
# waited at twice at once, or any failure that names the barrier's id.
_BARRIER = re.compile(r"Barrier (?:timed out\. Id: |Id: )?([\w:\-]+(?:\.[\w\-]+)*)")


def failed_barrier(error: BaseException) -> str | None:
    """The id of the key-value barrier between processes at which ``error`` (or an error it was raised from) failed;
    None when it is no failed barrier."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if "CoordinationServiceError" in text or type(current).__name__ == "JaxRuntimeError":
            found = _BARRIER.search(text)
            if found is not None and found.group(1) not in ("timed", "Id"):
                return found.group(1)
        current = current.__cause__ or current.__context__
    return None


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


# ---------------------------------------------------------------- TensorStore's JSON reference leak

_DECREF = ctypes.pythonapi.Py_DecRef
_DECREF.argtypes = [ctypes.py_object]
_DECREF.restype = None
_RELEASING = "__jddp_releases_json__"  # marks a wrapped function: wrapping is done once


def _release(value) -> None:
    """Drops the extra reference that TensorStore's JSON conversion left on every key and value of every dict in
    ``value`` (freshly returned by it, so nothing else holds them)."""
    if isinstance(value, dict):
        for key, item in list(value.items()):
            _release(item)
            _DECREF(key)
            _DECREF(item)
    elif isinstance(value, list):
        for item in value:
            _release(item)


def _extra_references(value) -> int:
    """The references too many on the first string value of a dict in ``value`` (0 without the leak, -1 if none)."""
    if isinstance(value, dict):
        for item in value.values():
            if isinstance(item, str) and len(item) > 1:  # a fresh object (not a cached one-character string)
                return sys.getrefcount(item) - 3  # the dict's, ``item``'s and getrefcount's own argument
            found = _extra_references(item)
            if found >= 0:
                return found
    elif isinstance(value, list):
        for item in value:
            found = _extra_references(item)
            if found >= 0:
                return found
    return -1


def _releasing(function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        result = function(*args, **kwargs)
        _release(result)
        return result

    setattr(call, _RELEASING, True)
    return call


def plug_tensorstore_json_leak() -> list[str]:
    """Wraps the TensorStore functions that Orbax calls and that leak what they return (see the module docstring);
    returns the names wrapped (none when TensorStore does not leak, or is missing). Idempotent."""
    try:
        import tensorstore as ts
    except ImportError:
        return []
    # (owner, name, a call of the original that returns a dict holding a fresh string)
    probes = [
        (ts, "experimental_collect_matching_metrics", lambda f: f("/tensorstore/", include_zero_metrics=True)),
        (ts.KvStore.Spec, "to_json", lambda f: f(ts.KvStore.Spec({"driver": "memory", "path": "jddp-probe/"}))),
        (ts.Spec, "to_json", lambda f: f(ts.Spec({"driver": "zarr", "kvstore": {"driver": "memory"}}))),
    ]
    wrapped = []
    for owner, name, probe in probes:
        function = getattr(owner, name, None)
        if function is None or getattr(function, _RELEASING, False):
            continue
        try:
            sample = probe(function)
        except Exception:  # another TensorStore's API: nothing known to plug
            continue
        if _extra_references(sample) != 1:
            continue
        _release(sample)
        setattr(owner, name, _releasing(function))
        wrapped.append(f"{getattr(owner, '__qualname__', owner.__name__)}.{name}")
    return wrapped


TENSORSTORE_JSON_WRAPPED = plug_tensorstore_json_leak()
