"""One all-reduce buffer per dtype: a pytree summed over an axis in as few passes as possible.

``lax.psum`` of a pytree gives one all-reduce *op* with one operand per leaf.
XLA:CPU runs such an op as one collective per operand, in sequence
(``AllReduceImpl`` loops over its buffers), and under
``jax_cpu_collectives_implementation="gloo"`` every simulated device is its own
gloo rank: one operand costs a full ring pass, ``2 * (ranks - 1)`` TCP hops.
With 2 processes x 4 devices (8 ranks) on this 2-core machine a pass over a
few bytes takes about 4 ms, so the MNIST-1D MLP step, whose all-reduce had 11
operands (6 gradient leaves, loss, count, metric totals and weights), spent
most of its 90 ms in ring latency. ``fused_psum`` ravels and concatenates the
leaves of each dtype into one vector, sums the vectors, and slices the results
back: one ring pass per dtype, whatever the number of leaves (PyTorch DDP's
gradient buckets, with a single bucket).

Packing costs a copy in and a copy out of every packed byte on every device,
while a pass saved is worth a fixed latency. So only leaves of at most
``MAX_LEAF_BYTES`` are packed; larger ones stay operands of their own, where
their pass's latency is small next to their transfer. Measured with
``benchmarks/multiprocess_step.py --hidden 2048`` (a 16 MiB weight): packing
every leaf made the one-process 1x8 step 1.6x slower than one buffer per leaf.

**Why packing was 17x slower in one process, and the fix.** Given the
concatenation, XLA:CPU fused the gradients' producers (the backward pass's
selects, reductions and the cross-entropy's scatter) into the one loop fusion
that writes the packed buffer. On the MNIST-1D MLP at 8 devices in one process,
the step took 43.8 ms against 2.6 ms per leaf; the all-reduce itself was not
the cause (alone, one buffer of the same bytes reduces faster than four). An
``optimization_barrier`` on the packed leaves keeps their producers out of the
concatenation: the same step then takes 1.6 ms, faster than one buffer per leaf
(2.8 ms), and ZeRO-1's packed step 1.6 ms against 3.2 ms.

One slow case remains in one process. When a leaf over ``MAX_LEAF_BYTES``
shares the all-reduce with the packed buffer (a 2048-wide MLP: its 16 MiB
weight alone), the step takes 2.5x as long as one buffer per leaf. Packing
every leaf instead costs 1.07x. Across processes the same mix is 1.29x faster
than one buffer per leaf (``benchmarks/multiprocess_step.py --hidden 2048``,
2x2). So by default ``DataParallel`` packs within one process only when no
leaf is that large (``fused_psum_unless_large``).

The sums are the same per-element sums; only the chunking of the ring, and so
the order in which a few partial sums are added, can differ, which changes a
result by float round-off at most. Every device receives the same bits, so
replicas stay identical.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

MAX_LEAF_BYTES = 1 << 20


def fused_psum(tree, axis_name: str, max_leaf_bytes: int = MAX_LEAF_BYTES):
    """``lax.psum(tree, axis_name)`` with the small leaves in one flat buffer per dtype.

    Args:
      tree: a pytree of arrays varying over ``axis_name`` (inside ``shard_map``).
      axis_name: the mesh axis to sum over.
      max_leaf_bytes: leaves larger than this are summed as operands of their own.

    Returns:
      A pytree of the same structure, shapes and dtypes holding the sums.
    """
    leaves, treedef = jax.tree.flatten(tree)
    groups, large = _grouped(leaves, max_leaf_bytes)
    leaves = _fenced(leaves, groups)
    flats = [jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]) for idx in groups.values()]
    summed, summed_large = lax.psum((flats, [leaves[i] for i in large]), axis_name)
    out = list(leaves)
    for i, x in zip(large, summed_large, strict=True):
        out[i] = x
    for idx, flat in zip(groups.values(), summed, strict=True):
        offset = 0
        for i in idx:
            size = int(np.prod(np.shape(leaves[i]), dtype=np.int64))
            out[i] = flat[offset : offset + size].reshape(np.shape(leaves[i]))
            offset += size
    return jax.tree.unflatten(treedef, out)


def fused_psum_unless_large(tree, axis_name: str, max_leaf_bytes: int = MAX_LEAF_BYTES):
    """``fused_psum`` when every leaf fits ``max_leaf_bytes``, else ``lax.psum`` of every leaf alone: the choice
    for devices of one process, where a large operand beside the packed buffer made the step 2.5x slower."""
    if any(_nbytes(x) > max_leaf_bytes for x in jax.tree.leaves(tree)):
        return lax.psum(tree, axis_name)
    return fused_psum(tree, axis_name, max_leaf_bytes)


def fused_psum_scatter(leaves: list, layouts: list, axis_name: str, num_devices: int,
                       max_leaf_bytes: int = MAX_LEAF_BYTES) -> list:  # fmt: skip
    """``lax.psum_scatter`` of each leaf along its layout's dimension, the small leaves in one buffer per dtype.

    Args:
      leaves: arrays in their stored shapes (padded: ``LeafLayout.pad``), varying over ``axis_name``.
      layouts: each leaf's ``jddp.runtime.layout.LeafLayout``, all of them split (``axis`` not None).
      axis_name: the mesh axis to sum over, of ``num_devices`` devices.
      max_leaf_bytes: leaves larger than this are reduce-scattered as operands of their own.

    Returns:
      Each leaf's slice on this device: the stored shape with ``axis`` divided by ``num_devices``. A leaf's slice
      for device ``i`` is the ``i``-th block of its dimension ``axis``, so each becomes row ``i`` of an
      ``[N, size / N]`` matrix (the dimension moved to the front); the rows of every leaf are laid side by side
      and one reduce-scatter hands device ``i`` the sum of row ``i``.
    """
    out: list = [None] * len(leaves)
    groups, large = _grouped(leaves, max_leaf_bytes)
    for i in large:
        out[i] = lax.psum_scatter(leaves[i], axis_name, scatter_dimension=layouts[i].axis, tiled=True)
    leaves = _fenced(leaves, groups)
    for idx in groups.values():
        rows = jnp.concatenate([jnp.moveaxis(leaves[i], layouts[i].axis, 0).reshape(num_devices, -1) for i in idx], 1)
        mine = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=False)  # row i, on device i
        offset = 0
        for i in idx:
            moved = _moved_slice_shape(np.shape(leaves[i]), layouts[i].axis, num_devices)
            size = int(np.prod(moved, dtype=np.int64))
            out[i] = jnp.moveaxis(mine[offset : offset + size].reshape(moved), 0, layouts[i].axis)
            offset += size
    return out


def fused_all_gather(slices: list, layouts: list, axis_name: str, num_devices: int,
                     max_leaf_bytes: int = MAX_LEAF_BYTES) -> list:  # fmt: skip
    """The inverse of ``fused_psum_scatter``'s split: every device's slice of each leaf gathered, the small leaves
    in one buffer per dtype. Returns the stored-shape leaves, the same on every device (invariant)."""
    out: list = [None] * len(slices)
    groups, large = _grouped(slices, max_leaf_bytes, num_devices)  # sized as gathered
    for i in large:
        out[i] = lax.all_gather(slices[i], axis_name, axis=layouts[i].axis, tiled=True, to="invarying")
    for idx in groups.values():
        flat = jnp.concatenate([jnp.ravel(jnp.moveaxis(slices[i], layouts[i].axis, 0)) for i in idx])
        every = lax.all_gather(flat, axis_name, axis=0, tiled=False, to="invarying")  # [N, slice sizes]
        offset = 0
        for i in idx:
            moved = np.shape(jnp.moveaxis(slices[i], layouts[i].axis, 0))
            size = int(np.prod(moved, dtype=np.int64))
            whole = every[:, offset : offset + size].reshape(num_devices * moved[0], *moved[1:])
            out[i] = jnp.moveaxis(whole, 0, layouts[i].axis)
            offset += size
    return out


def _nbytes(x) -> int:
    return int(np.dtype(x.dtype).itemsize * np.prod(np.shape(x), dtype=np.int64))


def _grouped(leaves, max_leaf_bytes: int, times: int = 1) -> tuple[dict[np.dtype, list[int]], list[int]]:
    """The indices of the leaves to pack, by dtype, and of those over ``max_leaf_bytes`` (``times`` their size)."""
    groups: dict[np.dtype, list[int]] = {}
    large = []
    for i, x in enumerate(leaves):
        if _nbytes(x) * times > max_leaf_bytes:
            large.append(i)
        else:
            groups.setdefault(np.dtype(x.dtype), []).append(i)
    return groups, large


def _fenced(leaves, groups: dict[np.dtype, list[int]]) -> list:
    """``leaves`` with the ones to pack behind one ``optimization_barrier``: it keeps XLA from fusing their
    producers (the backward pass) into the packing concatenation, which on CPU ran the MNIST-1D MLP step 17x
    slower in one process (the module docstring)."""
    out = list(leaves)
    packed = [i for idx in groups.values() for i in idx]
    for i, x in zip(packed, lax.optimization_barrier([out[i] for i in packed]), strict=True):
        out[i] = x
    return out


def _moved_slice_shape(shape: tuple, axis: int, num_devices: int) -> tuple:
    """The shape of one device's slice of a leaf of ``shape`` split along ``axis``, that dimension moved first."""
    rest = tuple(d for j, d in enumerate(shape) if j != axis)
    return (shape[axis] // num_devices, *rest)
