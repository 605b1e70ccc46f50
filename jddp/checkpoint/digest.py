"""Digests of the state's leaves and of the config, and the metadata item that carries them.

Orbax does not checksum: flipped bytes restore as garbage. Every checkpoint's
metadata holds one 64-bit digest per state leaf, computed on the devices, and
``Checkpointer`` recomputes them after a restore.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jddp.runtime import checksum
from jddp.runtime import state as state_lib
from jddp.runtime.layout import LeafLayout

# Dataclass field metadata key: a field with ``metadata={FINGERPRINT: False}`` (``jddp.config.run_field``) is left
# out of the config fingerprint, so that run settings (devices, log and checkpoint paths) may change on resume.
FINGERPRINT = "fingerprint"


@functools.partial(jax.jit, static_argnums=1)
def _digests(leaves: list[jax.Array], layouts: tuple[LeafLayout | None, ...]) -> jax.Array:
    if not leaves:
        return jnp.zeros((0, 2), jnp.uint32)
    # A padded leaf is digested without its padding (sliced in this program: no data moves), so that a digest
    # does not depend on the device count the state was split over.
    logical = [x if lay is None else lay.unpad(x) for x, lay in zip(leaves, layouts, strict=True)]
    return jnp.stack([checksum.leaf_checksum(x) for x in logical])


def digest_array(tree, layouts: list[LeafLayout | None] | None = None) -> jax.Array:
    """Per-leaf digests of ``tree`` as a uint32 [leaves, 2] array, dispatched asynchronously.

    A replicated leaf is digested once, on the device of its first local copy.

    Args:
      tree: a pytree of live jax.Arrays, at least one.
      layouts: per leaf, the ``LeafLayout`` it is stored with, or None (``leaf_layouts``); a padded leaf is
        digested as its logical value.

    Raises:
      TypeError: naming ``tree`` for a leaf that is not a ``jax.Array``, or ``layouts`` if it is not a list of
        ``LeafLayout`` or None.
      ValueError: naming ``tree`` for a tree without arrays or a donated array, ``layouts`` for a list whose
        length is not the number of leaves.
    """
    leaves = state_lib.check_tree("tree", tree, device=True, empty=False)
    stored = _checked_layouts(layouts, len(leaves))
    whole = [i for i, x in enumerate(leaves) if x.is_fully_replicated]
    split = [i for i, x in enumerate(leaves) if not x.is_fully_replicated]
    if not split:
        return _digests([leaves[i].addressable_shards[0].data for i in whole], (None,) * len(whole))
    # Leaves split over the devices (ZeRO-1's optimizer state) are digested where they live, in one program;
    # its replicated result joins the others' on one local device.
    parts = _digests([leaves[i] for i in split], tuple(stored[i] for i in split)).addressable_shards[0].data
    if not whole:
        return parts
    local = leaves[whole[0]].addressable_shards[0].data
    parts = jax.device_put(parts, next(iter(local.devices())))
    order = np.argsort(np.asarray(whole + split))
    return _merge(_digests([leaves[i].addressable_shards[0].data for i in whole], (None,) * len(whole)), parts, order)


def _checked_layouts(layouts: Any, count: int) -> list[LeafLayout | None]:
    if layouts is None:
        return [None] * count
    if not isinstance(layouts, list | tuple) or not all(x is None or isinstance(x, LeafLayout) for x in layouts):
        raise TypeError(
            f"`layouts` must be a list of jddp.runtime.layout.LeafLayout or None, one per leaf (`leaf_layouts`), or "
            f"None, got layouts={layouts!r:.60}."
        )
    if len(layouts) != count:
        raise ValueError(f"`layouts` must have one entry per leaf of `tree` ({count}), got {len(layouts)}.")
    return list(layouts)


@jax.jit
def _merge(first: jax.Array, second: jax.Array, order) -> jax.Array:
    return jnp.concatenate([first, second])[order]


def as_hex(digests) -> list[str]:
    return [f"{int(a):08x}{int(b):08x}" for a, b in np.asarray(digests)]


def state_digests(tree, layouts: list[LeafLayout | None] | None = None) -> list[str]:
    """One 64-bit hex digest per leaf of ``tree`` (of its logical value, given ``layouts``)."""
    return as_hex(jax.device_get(digest_array(tree, layouts)))


def describe_leaves(tree, layouts: list[LeafLayout | None] | None = None) -> list[list]:
    """``[path, shape, dtype]`` per leaf; the logical shape of a leaf stored with a layout."""
    stored: list[LeafLayout | None] = list(layouts) if layouts is not None else [None] * len(jax.tree.leaves(tree))
    return [
        [jax.tree_util.keystr(path), list(np.shape(x) if lay is None else lay.shape), str(x.dtype)]
        for (path, x), lay in zip(jax.tree.leaves_with_path(tree), stored, strict=True)
    ]


def empty_nodes(tree) -> list[str]:
    """The paths of the subtrees of ``tree`` that hold no array (optax's ``EmptyState``, an empty dict, None).

    They are the structure that the leaves' paths do not show: ``adam`` and ``adamw``, or ``sgd`` and a chain
    of clipping and ``sgd``, have the same leaves but not the same tree, and Orbax refuses to restore one into
    the other."""
    nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_childless)[0]
    return [jax.tree_util.keystr(path) for path, x in nodes if _childless(x)]


def _childless(x) -> bool:
    """A pytree node without children (``EmptyState()``, ``{}``, None), not an array."""
    structure = jax.tree.structure(x)
    return structure.num_nodes == 1 and structure.num_leaves == 0


def leaf_layouts(state) -> list[LeafLayout | None]:
    """Per leaf of ``restore.as_dict(state)`` (in flattening order), its ``LeafLayout`` when ``state`` keeps a
    sharded optimizer state, else None."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "opt_layout"}
    count = len(jax.tree.leaves(fields))
    if state.opt_layout is None:
        return [None] * count
    marks = {k: jax.tree.map(lambda _: _WHOLE, v) for k, v in fields.items()}
    opt_leaves, opt_def = jax.tree.flatten(fields["opt_state"])
    if len(opt_leaves) != len(state.opt_layout):
        raise ValueError(
            f"`state.opt_layout` describes {len(state.opt_layout)} leaves, but `state.opt_state` has "
            f"{len(opt_leaves)}; the state was not built by DataParallel.init or a step."
        )
    marks["opt_state"] = jax.tree.unflatten(opt_def, list(state.opt_layout))
    found = [None if x is _WHOLE else x for x in jax.tree.leaves(marks)]
    assert len(found) == count, (len(found), count)
    return found


_WHOLE = object()  # a leaf stored as it is


def config_fingerprint(config: Any | None) -> tuple[str, dict[str, Any]]:
    """A stable fingerprint of a config (dataclass, OmegaConf config, mapping) and its JSON form; ``("", {})`` for
    None (no config: a ``Checkpointer`` built without one).

    Dataclass fields made with ``jddp.config.run_field`` (where or how the run
    happens: devices, log directory) are left out, at any depth.
    """
    if config is None:
        return "", {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        plain = _fingerprinted(config)
    elif type(config).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        plain = OmegaConf.to_container(config, resolve=True)
    elif isinstance(config, Mapping):
        plain = dict(config)
    else:
        raise TypeError(f"`config` must be a dataclass, an OmegaConf config or a mapping, got {type(config).__name__}.")
    plain = json.loads(json.dumps(plain, sort_keys=True, default=str))
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16], plain


def _fingerprinted(value: Any) -> Any:
    """``dataclasses.asdict`` without the fields whose metadata says ``fingerprint: False``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _fingerprinted(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if f.metadata.get(FINGERPRINT, True)
        }
    if isinstance(value, list | tuple):
        return [_fingerprinted(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _fingerprinted(v) for k, v in value.items()}
    return value


class MetaHandler(ocp.JsonCheckpointHandler):
    """Orbax's JSON handler, except that ``"digests"`` may be a future of a ``jax.Array``, read in the background.

    ``Checkpointer.save`` dispatches the digest computation only after Orbax's
    blocking part (the copy of the arrays off the devices), so it neither waits
    for it nor delays that copy, and the digests still land inside the
    checkpoint before it is published.
    """

    async def _save_fn(self, x, directory):
        x = dict(x)
        digests = x.get("digests")
        if isinstance(digests, concurrent.futures.Future):
            digests = await asyncio.wrap_future(digests)
        if isinstance(digests, jax.Array):
            x["digests"] = as_hex(await asyncio.to_thread(jax.device_get, digests))
        await super()._save_fn(x, directory)


@ocp.args.register_with_handler(MetaHandler, for_save=True)
@dataclasses.dataclass
class MetaSave(ocp.args.CheckpointArgs):
    item: Mapping[str, Any]


@ocp.args.register_with_handler(MetaHandler, for_restore=True)
@dataclasses.dataclass
class MetaRestore(ocp.args.CheckpointArgs):
    item: Any = None
