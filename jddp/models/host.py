"""A ``TrainState``'s arrays back on the host: ``to_host``, read from this process's own replica."""

from __future__ import annotations

import jax
import numpy as np


def to_host(tree):
    """``tree`` (params, model state, a whole ``TrainState``) as NumPy arrays of their own (writable copies),
    read from this process's own replica: no communication, on any process.

    Raises:
      ValueError: a leaf is split over several processes (the optimizer state of ``shard_optimizer=True``
        across processes), so that no process holds it whole; names the leaf and the fix.
    """

    def host(path, x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_replicated:
            return np.array(x.addressable_shards[0].data)
        if not x.is_fully_addressable:
            raise ValueError(
                f"to_host reads this process's own copy, but the leaf {jax.tree_util.keystr(path)} (shape "
                f"{x.shape}, {x.sharding}) is split over several processes: no process holds it whole. Read the "
                "replicated parts (to_host(state.params), to_host(state.model_state)); the optimizer state of "
                "shard_optimizer=True is in the checkpoint, or gather it on every process at once with "
                "jax.experimental.multihost_utils.process_allgather."
            )
        return np.array(x)

    return jax.tree_util.tree_map_with_path(host, tree)
