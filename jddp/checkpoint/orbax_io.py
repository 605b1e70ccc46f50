"""Orbax's side of a ``Checkpointer``: its manager's options and item handlers, and the items one step is saved as
(the state, the loader position, ``extra`` and the metadata that ``jddp.checkpoint.restore`` reads back)."""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from jddp._version import __version__
from jddp.checkpoint import digest, storage
from jddp.checkpoint.restore import EXTRA, LOADER, META, STATE


def manager_options(
    *, read_only: bool, max_to_keep: int | None, async_save: bool, timeout_s: int
) -> ocp.CheckpointManagerOptions:
    """A writer's options (retention, clean-up of unfinished steps, async writes), or a reader's (none of those)."""
    return ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep,
        create=not read_only,
        cleanup_tmp_directories=not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=async_save and not read_only,
        async_options=ocp.AsyncOptions(timeout_secs=timeout_s),
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


def step_meta(step: int, tree: dict, layouts: list, *, fingerprint: str | None, config: Any) -> dict:
    """The ``meta`` item of ``step``: counts, versions, the config and its fingerprint, the leaves; its
    ``"digests"`` a future the caller sets (``digest.MetaHandler`` reads it in the background)."""
    return {
        "step": step,
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
