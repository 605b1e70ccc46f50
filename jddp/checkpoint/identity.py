"""The identity of the run that writes a checkpoint directory: its run id, kept in ``<directory>/jddp.run``.

What "the same run" is: the lineage of one checkpoint directory. The first writing ``Checkpointer`` of a
directory makes a run id (its start in UTC and 8 random hex digits) and writes it to ``jddp.run`` before anything
else is saved there; every later writer of the directory (a ``jddp launch --max-restarts`` restart, an elastic
round, a relaunch of the same job, a standby process woken) reads it back, so the id survives them all. A new run
at a path whose directory was deleted makes a new id. Every checkpoint's metadata and every in-memory snapshot
carries the id of the run that wrote it, with the config fingerprint where there is one and its leaves' paths,
shapes and dtypes; a restore compares them with the directory's (``jddp.checkpoint.restore``,
``jddp.checkpoint.snapshot_format``).

``jddp.run`` is JSON: ``{"format": 1, "run": id, "created": time}``. Process 0 reads or writes it (a writer holds
the directory's lease then) and sends the id to the others, so every process holds the same one. A file that
cannot be read (cut short, garbage, a directory in its place, another format) is set aside as
``jddp.run.damaged`` with a ``CheckpointWarning`` naming it; the id is then taken from the newest checkpoint's
metadata that has one, else made anew.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import warnings

import jax
import numpy as np

from jddp.checkpoint.errors import CheckpointWarning

FILENAME = "jddp.run"
FORMAT = 1
DAMAGED = ".damaged"
_ID_BYTES = 64  # the most an id sent to the other processes may take


def new_run_id() -> str:
    """A new run's id: its start in UTC to the second and 8 random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(4)


def describe(run: str | None, fingerprint: str | None) -> str:
    """A run's identity in words, for messages: its id and config fingerprint."""
    named = f"run {run}" if run else "a run without an id (an older jddp)"
    return named + (f" (config fingerprint {fingerprint})" if fingerprint else " (no config fingerprint)")


def read(directory) -> tuple[str | None, str | None]:
    """``(run id, None)`` from the directory's ``jddp.run``; ``(None, None)`` when there is none; ``(None, why)``
    when it cannot be used."""
    path = directory / FILENAME
    try:
        if not path.exists():
            return None, None
        info = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # a directory in its place, unreadable, not JSON, not UTF-8
        return None, f"{type(error).__name__}: {error}"
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        found = info.get("format") if isinstance(info, dict) else type(info).__name__
        return None, f"format {found!r}, expected {FORMAT}"
    run = info.get("run")
    if not isinstance(run, str) or not run or len(run.encode()) > _ID_BYTES or not run.isprintable():
        return None, f"its run id is {run!r}, expected a short non-empty string"
    return run, None


def _write(directory, run: str) -> None:
    path = directory / FILENAME
    text = json.dumps({"format": FORMAT, "run": run, "created": time.time()})
    if hasattr(path, "rmtree"):  # etils.epath (gs://, s3://): no atomic rename needed for a small object
        path.write_text(text)
        return
    tmp = path.with_name(f".{FILENAME}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _set_aside(directory, why: str, *, read_only: bool) -> None:
    path = directory / FILENAME
    if read_only:
        what = "left in place (read-only)"
    else:
        target, n = directory / f"{FILENAME}{DAMAGED}", 1
        while target.exists():
            n += 1
            target = directory / f"{FILENAME}{DAMAGED}{n}"
        path.rename(target)
        what = f"moved to {target.name}"
    warnings.warn(
        f"The run file {path} of the checkpoint directory cannot be used ({why}); {what}. The run id is taken from "
        "the newest checkpoint that names one, or made anew.",
        CheckpointWarning,
        stacklevel=4,
    )


def directory_run(directory, newest_meta_run, *, read_only: bool) -> str | None:
    """The run id of ``directory``, the same on every process (process 0's, sent to the others).

    Args:
      newest_meta_run: a function returning the run id in the newest checkpoint's metadata, or None (the id of a
        directory without a usable ``jddp.run``: written by an older jddp, or its file damaged).
      read_only: a reader writes nothing; its id is None for a directory that holds no run.
    """
    run = None
    if jax.process_index() == 0:
        run, why = read(directory)
        if why is not None:
            _set_aside(directory, why, read_only=read_only)
        if run is None:
            run = newest_meta_run()
            if run is None and not read_only:
                run = new_run_id()
            if run is not None and not read_only:
                _write(directory, run)
    return _agreed(run)


def _agreed(run: str | None) -> str | None:
    """Process 0's ``run`` on every process (one broadcast in a group)."""
    if jax.process_count() == 1:
        return run
    from jax.experimental import multihost_utils

    from jddp.runtime import first_run, watchdog

    data = np.zeros(_ID_BYTES + 1, np.uint8)
    if run is not None:
        raw = run.encode()
        data[0], data[1 : 1 + len(raw)] = 1, np.frombuffer(raw, np.uint8)
    first_run.meet_once(first_run.GLOBAL_DEVICES, "a Checkpointer's run id")  # gloo's window opens with all
    with watchdog.waiting():
        data = np.asarray(multihost_utils.broadcast_one_to_all(data, is_source=jax.process_index() == 0))
    return bytes(data[1:]).rstrip(b"\0").decode() if data[0] else None
