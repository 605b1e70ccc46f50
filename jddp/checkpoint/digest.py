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

# Dataclass field metadata key: a field with ``metadata={FINGERPRINT: False}`` (``jddp.config.run_field``) is left
# out of the config fingerprint, so that run settings (devices, log and checkpoint paths) may change on resume.
FINGERPRINT = "fingerprint"


def _leaf_digest(x: jax.Array) -> jax.Array:
    """Two weighted sums of the leaf's 32-bit words, mod 2^32.

    The words form rows of 1024; one sum weights each word by an odd constant of
    its column, the other weights each row's sum by an odd constant of its row.
    Odd weights make any change of a single word change the first sum. A typed
    PRNG key is digested through its key data.
    """
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:  # bitcast refuses bool: its bytes as uint8 (a bool model-state leaf, a flag)
        x = x.astype(jnp.uint8)
    if x.dtype.itemsize == 2:
        words = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    elif x.dtype.itemsize == 1:
        words = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    else:  # 4 bytes, or two words per 8-byte element
        words = jax.lax.bitcast_convert_type(x, jnp.uint32)
    words = words.reshape(-1)
    pad = -words.size % 1024
    rows = jnp.pad(words, (0, pad)).reshape(-1, 1024)
    columns = (jnp.arange(1024, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1)) | jnp.uint32(1)
    row_weights = (jnp.arange(rows.shape[0], dtype=jnp.uint32) * jnp.uint32(0x85EBCA77)) | jnp.uint32(1)
    row_sums = jnp.sum(rows * columns[None, :], axis=1, dtype=jnp.uint32)
    size = jnp.uint32(words.size)
    return jnp.stack([jnp.sum(row_sums, dtype=jnp.uint32) ^ size, jnp.sum(row_sums * row_weights, dtype=jnp.uint32)])


@jax.jit
def _digests(leaves: list[jax.Array]) -> jax.Array:
    return jnp.stack([_leaf_digest(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


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
