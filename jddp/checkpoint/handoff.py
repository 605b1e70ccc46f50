"""What an async save hands to Orbax: one replica per process, and the buffers pinned while Orbax reads them."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def one_copy_per_process(x: Any) -> Any:
    """A replicated array as the same values on one device per process, sharing that device's buffer.

    Orbax splits the writing of a replicated array among its replicas
    (``use_replica_parallel``), slicing every local replica with a JAX op while
    the caller waits. Handed one replica per process, it slices nothing in a
    single process (the shard is copied to the host as a view) and one slice
    per process in a group, so every process still writes its share. The
    devices are chosen from the sharding alone (the lowest id of each
    process), hence the same on every process. The saved values, and so the
    restore into any sharding, are unchanged.
    """
    if (
        not isinstance(x, jax.Array)
        or not x.is_fully_replicated
        or len(x.sharding.device_set) == 1
        or jnp.issubdtype(x.dtype, jax.dtypes.extended)
    ):
        return x
    first: dict[int, jax.Device] = {}  # pyright: ignore[reportInvalidTypeForm]  # jax.Device is public, but an alias variable
    for device in sorted(x.sharding.device_set, key=lambda d: d.id):
        first.setdefault(device.process_index, device)
    mine = first[jax.process_index()]
    shard = next(s.data for s in x.addressable_shards if s.device == mine)
    return jax.make_array_from_single_device_arrays(x.shape, _replicated_on(tuple(first.values())), [shard])


def on_cpu(tree) -> bool:
    return all(d.platform == "cpu" for x in jax.tree.leaves(tree) for d in x.sharding.device_set)


def _host_view(x: jax.Array) -> np.ndarray:
    """A host view of a single-device array's buffer (on CPU: no copy); a typed PRNG key through its key data."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)  # shares the key array's buffer
    return np.asarray(x)


def pin(tree) -> list[np.ndarray]:
    """Host views of every local buffer of ``tree``; while they live, no step can donate them (JAX skips the donation).

    A typed PRNG key is pinned through its key data, which shares its buffer:
    ``wrap_key_data(key_data(x))`` would share it too, and a later step would
    donate it from under the writer thread.
    """
    return [_host_view(s.data) for x in jax.tree.leaves(tree) for s in x.addressable_shards]


@functools.lru_cache(maxsize=16)
def _replicated_on(
    devices: tuple[jax.Device, ...],  # pyright: ignore[reportInvalidTypeForm]  # jax.Device is public, but an alias variable
) -> jax.sharding.NamedSharding:
    mesh = jax.sharding.Mesh(np.array(devices), ("replica",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
