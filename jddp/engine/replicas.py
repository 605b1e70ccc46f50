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


def broadcast_from_process_0(tree):
    """Process 0's value of ``tree`` (host arrays of equal shapes everywhere), on every process.

    DDP's constructor does the same: replicas start from rank 0's parameters,
    whatever seed each process used. A single process gets ``tree`` back.
    """
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    _assert_same_structure(tree)
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def _assert_same_structure(tree) -> None:
    """Compares a fixed-size digest of the paths, shapes and dtypes across processes (a differing tree would
    otherwise hang the broadcast)."""
    import hashlib

    from jax.experimental import multihost_utils

    described = [
        (jax.tree_util.keystr(p), np.shape(x), str(np.asarray(x).dtype)) for p, x in jax.tree.leaves_with_path(tree)
    ]
    digest = np.frombuffer(hashlib.blake2b(repr(described).encode(), digest_size=8).digest(), np.uint32)
    every = np.asarray(multihost_utils.process_allgather(digest))
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        raise ValueError(
            f"The state passed to DataParallel.init has other leaves, shapes or dtypes on process(es) {differ} than "
            "on process 0. Every process must build the same model with the same shapes."
        )


def leaf_digests(tree) -> np.ndarray:
    """One 32-bit digest per leaf (path, dtype, shape and bytes of its first addressable shard)."""
    import hashlib

    digests = []
    for path, leaf in jax.tree.leaves_with_path(tree):
        data = np.asarray(leaf.addressable_shards[0].data if isinstance(leaf, jax.Array) else leaf)
        h = hashlib.blake2b(digest_size=4)
        h.update(f"{jax.tree_util.keystr(path)}|{data.dtype}|{data.shape}|".encode())
        h.update(np.ascontiguousarray(data).tobytes())
        digests.append(int.from_bytes(h.digest(), "little"))
    return np.asarray(digests, np.uint32)


def assert_same_on_every_process(tree, what: str = "state") -> None:
    """Compares per-leaf digests of ``tree`` across processes (a collective: every process must call it).

    Raises:
      AssertionError: naming the processes whose value differs from process 0's
        and the first leaf that differs.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    local = leaf_digests(tree)
    every = np.asarray(multihost_utils.process_allgather(local))  # [processes, leaves]
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(tree)]
        first = int(np.flatnonzero(every[differ[0]] != every[0])[0])
        raise AssertionError(
            f"The {what} differs between processes: process(es) {differ} differ from process 0, first at "
            f"{what}{paths[first]}. Every process must build the same model, and jddp broadcasts process 0's "
            "values in `DataParallel.init`; a difference afterwards means a process updated its state on its own."
        )
