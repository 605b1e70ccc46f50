"""Placing replicated values and checking that replicas agree."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp import runtime
from jddp.runtime import checksum, first_run

DATA = runtime.DATA_AXIS


class ReplicaMismatchError(AssertionError):
    """Replicas of the training state that should be bit-identical are not (a host-specific code path, a device
    or memory fault, a process that updated its state on its own)."""


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


def broadcast_from_process_0(tree, what: str = "jddp's broadcast from process 0 (DataParallel.init, data_parallel)"):
    """Process 0's value of ``tree`` (host arrays of equal shapes everywhere), on every process.

    DDP's constructor does the same: replicas start from rank 0's parameters,
    whatever seed each process used. A single process gets ``tree`` back. Often
    the group's first collective (``DataParallel.init``'s, a ``data_parallel``
    step's first placing), so every process meets before it
    (``jddp.runtime.first_run``, named by ``what`` if one is late).
    """
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    first_run.meet_once(first_run.GLOBAL_DEVICES, what)
    with first_run.explained(what):
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
    """One 32-bit digest per replicated leaf (path, dtype, shape and bytes of its first addressable shard); a leaf
    split over the devices (ZeRO-1's optimizer state) holds other values on each process and is left out."""
    import hashlib

    digests = []
    for path, leaf in jax.tree.leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_replicated:
            continue
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
    first_run.meet_once(first_run.GLOBAL_DEVICES, f"the check that every process holds the same {what}")
    with first_run.explained(f"the check that every process holds the same {what}"):
        every = np.asarray(multihost_utils.process_allgather(local))  # [processes, leaves]
    differ = [p for p in range(every.shape[0]) if not np.array_equal(every[p], every[0])]
    if differ:
        paths = [
            jax.tree_util.keystr(p)
            for p, x in jax.tree.leaves_with_path(tree)
            if not isinstance(x, jax.Array) or x.is_fully_replicated
        ]
        first = int(np.flatnonzero(every[differ[0]] != every[0])[0])
        raise AssertionError(
            f"The {what} differs between processes: process(es) {differ} differ from process 0, first at "
            f"{what}{paths[first]}. Every process must build the same model, and jddp broadcasts process 0's "
            "values in `DataParallel.init`; a difference afterwards means a process updated its state on its own."
        )


def check_replicas(tree, mesh: Mesh) -> None:
    """Compares a 64-bit checksum of every replica of every replicated leaf of ``tree``, on every device of
    ``mesh`` (all processes: a collective, call it on every process).

    Each device checksums its own copy (one program; every byte read once on its device), the checksums are
    all-gathered, and every process compares the same table, so all of them raise or none does.

    Raises:
      ReplicaMismatchError: naming the first leaf whose replicas differ, the devices and processes that differ
        from the majority, and how many agree.
    """
    with_paths = [(p, x) for p, x in jax.tree.leaves_with_path(tree) if isinstance(x, jax.Array)]
    program, leaves = checksum_program(tree, mesh)
    if not leaves:
        return
    table = np.asarray(program(*leaves))  # [devices, leaves, 2], replicated
    paths = [jax.tree_util.keystr(p) for p, x in with_paths if x.is_fully_replicated and x.size]
    devices = list(mesh.devices.flat)
    for leaf in range(table.shape[1]):
        rows = [tuple(r) for r in table[:, leaf]]
        if len(set(rows)) == 1:
            continue
        majority = max(set(rows), key=rows.count)
        odd = [i for i, r in enumerate(rows) if r != majority]
        named = ", ".join(f"device {devices[i].id} (process {devices[i].process_index})" for i in odd)
        raise ReplicaMismatchError(
            f"Replicas differ at state{paths[leaf]}: {named} differ from the other {len(rows) - len(odd)} of "
            f"{len(rows)} replicas. Replicas must stay bit-identical (every update is computed from the same "
            "all-reduced gradient): a host-specific code path, a faulty device or memory, or a process that changed "
            "its state on its own. Resume from the last checkpoint."
        )


def checksum_program(tree, mesh: Mesh) -> tuple[Any, list[jax.Array]]:
    """The jitted checksum program of ``check_replicas`` for ``tree`` on ``mesh``, and the leaves it takes (the
    replicated, non-empty arrays of ``tree``)."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and x.is_fully_replicated and x.size]
    return _checksums(mesh, len(leaves)), leaves


@functools.lru_cache(maxsize=32)
def _checksums(mesh: Mesh, count: int):
    """The jitted per-device checksum program for ``count`` replicated leaves on ``mesh``."""

    def per_device(*leaves):
        # Each device holds its own copy of a replicated leaf; cast to varying so that the copies count as
        # different values (an invariant value's all_gather could be formed without communication).
        sums = jnp.stack([checksum.leaf_checksum(lax.pcast(x, DATA, to="varying")) for x in leaves])
        return lax.all_gather(sums, DATA, to="invarying")

    specs = (P(),) * count
    return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=P()))
