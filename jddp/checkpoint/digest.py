"""Digests of the state's leaves and of the config, and the metadata item that carries them.

Orbax does not checksum: flipped bytes restore as garbage. Every checkpoint's
metadata holds one 64-bit digest per state leaf, computed on the devices, and
``Checkpointer`` recomputes them after a restore.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jddp.runtime import checksum

# Dataclass field metadata key: a field with ``metadata={FINGERPRINT: False}`` (``jddp.config.run_field``) is left
# out of the config fingerprint, so that run settings (devices, log and checkpoint paths) may change on resume.
FINGERPRINT = "fingerprint"


@jax.jit
def _digests(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([checksum.leaf_checksum(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def digest_array(tree) -> jax.Array:
    """Per-leaf digests of ``tree`` as a uint32 [leaves, 2] array, dispatched asynchronously.

    A replicated leaf is digested once, on the device of its first local copy.
    """
    leaves = [x.addressable_shards[0].data if x.is_fully_replicated else x for x in jax.tree.leaves(tree)]
    return _digests(leaves)


def as_hex(digests) -> list[str]:
    return [f"{int(a):08x}{int(b):08x}" for a, b in np.asarray(digests)]


def state_digests(tree) -> list[str]:
    """One 64-bit hex digest per leaf of ``tree``."""
    return as_hex(jax.device_get(digest_array(tree)))


def describe_leaves(tree) -> list[list]:
    return [
        [jax.tree_util.keystr(path), list(np.shape(x)), str(x.dtype)] for path, x in jax.tree.leaves_with_path(tree)
    ]


def config_fingerprint(config: Any) -> tuple[str, dict[str, Any]]:
    """A stable fingerprint of a config (dataclass, OmegaConf config, mapping) and its JSON form.

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
