"""Placing replicated values and checking that replicas agree."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding


def put_replicated(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``x`` (a host array) as a global array held whole on every device of ``sharding``.

    Every device gets its own copy, so no device buffer aliases ``x`` or another
    device's buffer, and donation is safe. Works in multi-process runs when
    every process passes the same value.
    """
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: np.array(x[index], copy=True))


def assert_identical(tree) -> None:
    """Asserts every addressable replica of every leaf is bit-identical.

    Raises:
      AssertionError: naming the leaf path and the device that differs from the
        leaf's first addressable shard.
    """
    for path, leaf in jax.tree.leaves_with_path(tree):
        if not isinstance(leaf, jax.Array):
            continue
        shards = leaf.addressable_shards
        reference = np.asarray(shards[0].data)
        for shard in shards[1:]:
            if shard.index != shards[0].index:
                continue
            data = np.asarray(shard.data)
            if data.tobytes() != reference.tobytes():
                raise AssertionError(
                    f"Replicas differ at state{jax.tree_util.keystr(path)}: device {shard.device} "
                    f"differs from device {shards[0].device} (max abs difference "
                    f"{np.max(np.abs(data.astype(np.float64) - reference.astype(np.float64)))})."
                )
