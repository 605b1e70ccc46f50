"""A 64-bit checksum of an array's bits, computed on its device: checkpoint digests and replica checks use it.

Pure ``jax.numpy``: it runs inside ``jit`` and ``shard_map`` (each device on its own copy of a replicated
array) and reads every word once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def leaf_checksum(x: jax.Array) -> jax.Array:
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
