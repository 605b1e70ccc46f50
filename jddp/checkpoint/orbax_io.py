"""Orbax's side of a ``Checkpointer``: its manager's options and item handlers, and the items one step is saved as
(the state, the loader position, ``extra`` and the metadata that ``jddp.checkpoint.restore`` reads back)."""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from jddp._version import __version__
from jddp.checkpoint import digest, storage
from jddp.checkpoint.restore import EXTRA, LOADER, META, META_FORMAT, STATE

# Checkpointers opened in this process, by directory: the n-th of a directory gets its n-th barrier prefix.
_OPENED: collections.Counter[str] = collections.Counter()
_OPENED_LOCK = threading.Lock()


def barrier_prefix(directory) -> str:
    """The prefix of every key-value barrier that Orbax's manager of this ``Checkpointer`` waits at: the same on
    every process, and another for every ``Checkpointer`` open in the process.

    Orbax names its barriers by what they do, not by manager: every manager's background write waits at
    ``ThreadSaveMultiHostValueHolder:set_value_start`` (``orbax/checkpoint/_src/futures/synchronization.py``,
    ``MultihostSynchronizedValue.set``, called by ``CheckpointManager.save`` and by its finalize thread), and at
    ``async_write_complete.<step>`` (``_src/checkpointers/async_checkpointer.py``). Two managers of one run (an
    epoch checkpoint and the best model) then wait at one barrier from two threads, and the coordination service
    refuses the second: "Barrier ... is already ongoing". Orbax prefixes every key with
    ``MultiprocessingOptions.barrier_sync_key_prefix``; jddp gives each Checkpointer its own. Every process
    opens its Checkpointers in the same order (a collective call), so the n-th Checkpointer of a directory has the
    same prefix on every process: the directory's hash and n.
    """
    key = hashlib.sha1(str(directory).encode()).hexdigest()[:12]
    with _OPENED_LOCK:
        _OPENED[key] += 1
        return f"jddp-{key}-{_OPENED[key]}"


def manager_options(
    *, read_only: bool, max_to_keep: int | None, async_save: bool, timeout_s: int, barrier_prefix: str
) -> ocp.CheckpointManagerOptions:
    """A writer's options (retention, clean-up of unfinished steps, async writes), or a reader's (none of those);
    ``barrier_prefix`` (``barrier_prefix()``) keeps its barriers apart from another manager's."""
    return ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep,
        create=not read_only,
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=async_save and not read_only,
        async_options=ocp.AsyncOptions(timeout_secs=timeout_s),
        multiprocessing_options=ocp.options.MultiprocessingOptions(barrier_sync_key_prefix=barrier_prefix),
    )


def open_manager(directory: str | os.PathLike, options: ocp.CheckpointManagerOptions) -> ocp.CheckpointManager:
    """Orbax's manager of ``directory``, with a handler per item, its start-up clean-up finished."""
    handlers = {
        STATE: ocp.StandardCheckpointHandler(),
        LOADER: ocp.JsonCheckpointHandler(),
        EXTRA: ocp.JsonCheckpointHandler(),
        META: digest.MetaHandler(),
    }
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    storage.finish_cleanup(manager)
    return manager


def step_meta(step: int, tree: dict, layouts: list, *, fingerprint: str | None, config: Any, run: str | None) -> dict:
    """The ``meta`` item of ``step``: counts, versions, the run that wrote it, the config and its fingerprint, the
    leaves; its ``"digests"`` a future the caller sets (``digest.MetaHandler`` reads it in the background)."""
    return {
        "format": META_FORMAT,
        "step": step,
        "run": run,  # jddp.checkpoint.identity
        "processes": jax.process_count(),
        "devices": jax.device_count(),
        "config_fingerprint": fingerprint,
        "config": config,
        "versions": {"jddp": __version__, "jax": jax.__version__, "orbax": orbax_version()},
        "leaves": digest.describe_leaves(tree, layouts),  # logical shapes: a sharded state's padding varies
        "empty_nodes": digest.empty_nodes(tree),  # the rest of the structure (an optimizer's EmptyStates)
        "padded": any(lay is not None and lay.padded for lay in layouts),
        "digests": concurrent.futures.Future(),  # set by the caller; read by MetaHandler in the background
        "time": time.time(),
    }


def step_items(saved: dict, meta: dict, loader, extra) -> dict:
    """Orbax's save arguments of one step by item: ``saved`` (the state's arrays), ``meta``, and the positions of
    ``loader`` and ``extra`` when given."""
    items = {STATE: ocp.args.StandardSave(saved), META: digest.MetaSave(meta)}
    if loader is not None:
        items[LOADER] = ocp.args.JsonSave(loader.get_state())
    if extra is not None:
        items[EXTRA] = ocp.args.JsonSave(extra.get_state())
    return items


def orbax_version() -> str:
    from importlib.metadata import version

    return version("orbax-checkpoint")
