"""A snapshot file's format: which local shards a state's snapshot holds and where (its layout), their bytes packed
into one buffer per device, and a file's bytes decoded back into arrays.

A file: 8 bytes (little-endian header length), the header (JSON: the step, the process and device counts, the
run that wrote it (``jddp.checkpoint.identity``) and its config fingerprint, every leaf's path, shape and dtype,
every local shard's index, offset and size, a CRC-32 of the data, the loader position and ``extra``), then the
data: the process's local shards (one copy of a replicated leaf, each distinct shard of a split one), as bytes.
``jddp.checkpoint.snapshot`` writes them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp.checkpoint import identity

FORMAT = 1
HEADER_LENGTH = struct.Struct("<Q")


class Unusable(Exception):
    """A snapshot that cannot be restored here; the message says why."""


class OtherRun(Unusable):
    """A snapshot written by another run (another run id or config fingerprint than the checkpoint directory's):
    never restored, and removed by the restore that found it."""


def _normal_index(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices) as ``((start, stop), ...)`` per dimension."""
    return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(index, shape, strict=True))


def _as_bytes(x: jax.Array) -> jax.Array:
    """``x``'s bytes, flat, as uint8 (bit-exact; a bool as 0/1)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).ravel()
    return jax.lax.bitcast_convert_type(x, jnp.uint8).ravel()


@jax.jit
def pack(shards: list[jax.Array]) -> jax.Array:
    """The shards of one device, their bytes one after the other: a new buffer that no later step donates."""
    return jnp.concatenate([_as_bytes(x) for x in shards]) if shards else jnp.zeros((0,), jnp.uint8)


@jax.jit
def copies(shards: list[jax.Array]) -> list[jax.Array]:
    """``pack``'s bytes, one buffer per shard: ``joined`` on the host makes them ``pack``'s buffer. A step's copy
    kept in case it is written (``jddp.checkpoint.snapshot_kept``): XLA:CPU's concatenation of ``pack`` takes about
    3 times as long (MNIST-1D MLP's 0.95 MB: 0.58 ms against 0.20 ms, waited for, 2-core VM, 29 Nov 2026)."""
    return [_as_bytes(x) for x in shards]


def joined(buffer: jax.Array | list[jax.Array]) -> np.ndarray:
    """A device's buffer on the host as one uint8 array: ``pack``'s as it is (a view on CPU), ``copies``' joined."""
    if not isinstance(buffer, list):
        return np.asarray(buffer)
    parts = [np.asarray(b) for b in buffer]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


@dataclasses.dataclass
class Layout:
    """Which local shards a state's snapshot holds, and where: computed once per state structure and shardings."""

    leaves: list[list]  # [path, shape, dtype, key implementation or None]
    shards: list[list]  # [leaf, index, device position, offset in its device's buffer, nbytes]
    # per device, in buffer order: (leaf, its local shard's position, or None where the leaf is on this one device
    # alone, and whether it is a PRNG key, whose key data is copied)
    picks: list[list[tuple[int, int | None, bool]]]
    whole: bool  # every leaf whole (replicated): every process of the host holds the same snapshot
    text: str = dataclasses.field(init=False)  # the header's "leaves" and "shards" as JSON, without its braces

    def __post_init__(self) -> None:
        self.text = json.dumps({"leaves": self.leaves, "shards": self.shards})[1:-1]


def shard_layout(tree) -> Layout:
    paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    leaves, shards, picks = [], [], []
    device_at: dict[Any, int] = {}
    offsets: list[int] = []
    for i, (path, x) in enumerate(paths_leaves):
        impl = None
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(x))
            data_dtype = jax.random.key_data(x).dtype
            data_shape = tuple(x.shape) + tuple(jax.random.key_data(x).shape[x.ndim :])
        else:
            data_dtype, data_shape = x.dtype, tuple(x.shape)
        leaves.append([jax.tree_util.keystr(path), list(data_shape), str(jnp.dtype(data_dtype)), impl])
        seen = set()
        for position, shard in enumerate(x.addressable_shards):
            # a PRNG key array's shard index may also cover its key data's dimensions (JAX 0.10 does): those are whole
            index = _normal_index(tuple(shard.index)[: x.ndim], tuple(x.shape)) + tuple(
                (0, n) for n in data_shape[x.ndim :]
            )
            if index in seen:
                continue
            seen.add(index)
            if shard.device not in device_at:
                device_at[shard.device] = len(picks)
                picks.append([])
                offsets.append(0)
            d = device_at[shard.device]
            nbytes = math.prod(b - a for a, b in index) * jnp.dtype(data_dtype).itemsize
            shards.append([i, [list(p) for p in index], d, offsets[d], nbytes])
            picks[d].append((i, position if len(x.sharding.device_set) > 1 else None, impl is not None))
            offsets[d] += nbytes
    whole = all([list(p) for p in index] == [[0, n] for n in leaves[leaf][1]] for leaf, index, *_ in shards)
    return Layout(leaves, shards, picks, whole)


# What a file's damage may raise while its header or data is read (cut short, garbage, NaN or wrong types in the
# header's fields): each becomes ``Unusable``, naming the error.
DAMAGE = (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError, struct.error, UnicodeError)


def decode(file: np.ndarray, step: int, tree: dict, fingerprint: str | None, *, run: str | None, whole: bool = False):
    """``(arrays by field in tree's shardings, loader position, extra state)`` of a snapshot file's bytes.

    Args:
      run: the run id of the checkpoint directory (``jddp.checkpoint.identity``); ``fingerprint`` its config's.

    Raises:
      OtherRun: the snapshot was written by another run (run id or config fingerprint), both named.
      Unusable: see ``Snapshots.load``; with ``whole``, also for a snapshot that holds parts of split leaves;
        also for any damage of its bytes (never another error).
    """
    try:
        return _decode(file, step, tree, fingerprint, run=run, whole=whole)
    except DAMAGE as error:
        raise Unusable(f"snapshot of step {step} cannot be read ({type(error).__name__}: {error})") from error


def _decode(file: np.ndarray, step: int, tree: dict, fingerprint: str | None, *, run: str | None, whole: bool):
    (length,) = HEADER_LENGTH.unpack_from(file.data, 0)
    header = json.loads(file[HEADER_LENGTH.size : HEADER_LENGTH.size + length].tobytes())
    if not isinstance(header, dict):
        raise Unusable(f"snapshot of step {step}: its header is a {type(header).__name__}, not a JSON object")
    if header.get("format") != FORMAT or header.get("step") != step:
        raise Unusable(f"snapshot of step {step}: format {header.get('format')}, step {header.get('step')}")
    if header.get("run") != run or header.get("fingerprint") != fingerprint:
        raise OtherRun(
            f"snapshot of step {step} was written by {identity.describe(header.get('run'), header.get('fingerprint'))}"
            f", the checkpoint directory is {identity.describe(run, fingerprint)}: another run's state (a new run "
            "at the path of a stopped one?), never restored"
        )
    here: dict[str, Any] = {}
    if not whole:  # a snapshot of whole leaves restores onto any process and device count, as a checkpoint does
        here.update(processes=jax.process_count(), devices=jax.device_count())
    for name, value in here.items():
        if header.get(name) != value:
            raise Unusable(f"snapshot of step {step} has {name} {header.get(name)!r}, here {value!r}")
    layout = shard_layout(tree)
    if [lf[:3] for lf in header["leaves"]] != [lf[:3] for lf in layout.leaves]:
        raise Unusable(f"snapshot of step {step} holds another state (leaves' paths, shapes or dtypes differ)")
    start = HEADER_LENGTH.size + length
    data = file[start : start + sum(header["sizes"])]
    if data.size != sum(header["sizes"]):
        raise Unusable(f"snapshot of step {step} is cut short ({file.size} bytes)")
    if zlib.crc32(data.data) != header["crc32"]:
        raise Unusable(f"snapshot of step {step} is damaged (CRC-32 mismatch)")
    if whole and any(
        list(map(tuple, index)) != [(0, n) for n in header["leaves"][leaf][1]] for leaf, index, *_ in header["shards"]
    ):
        raise Unusable(f"snapshot of step {step} holds parts of split leaves (ZeRO-1): it restores only its process")
    device_starts = np.cumsum([0, *header["sizes"]])
    by_leaf: dict[int, dict[tuple, np.ndarray]] = {}
    for leaf, index, device, offset, nbytes in header["shards"]:
        name, _, dtype, _ = header["leaves"][leaf]
        shape = tuple(b - a for a, b in index)
        raw = data[device_starts[device] + offset : device_starts[device] + offset + nbytes]
        value = raw.astype(np.bool_) if dtype == "bool" else raw.view(jnp.dtype(dtype))
        by_leaf.setdefault(leaf, {})[tuple(tuple(p) for p in index)] = value.reshape(shape)
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for i, x in enumerate(leaves):
        shards = by_leaf.get(i, {})
        impl = header["leaves"][i][3]
        extra_dims = tuple((0, n) for n in header["leaves"][i][1][x.ndim :])

        def piece(index, x=x, shards=shards, extra_dims=extra_dims):
            key = _normal_index(index, tuple(x.shape)) + extra_dims
            if key not in shards:
                raise Unusable(f"snapshot of step {step} lacks the shard {key} of a leaf (another sharding)")
            return shards[key]

        if impl is not None:
            data_shape = tuple(header["leaves"][i][1])
            sharding = jax.random.key_data(x).sharding
            rank = x.ndim
            raw = jax.make_array_from_callback(data_shape, sharding, lambda index, p=piece, r=rank: p(index[:r]))  # pyright: ignore[reportOptionalSubscript]
            out.append(jax.random.wrap_key_data(raw, impl=jax.random.key_impl(x)))
        else:
            out.append(jax.make_array_from_callback(tuple(x.shape), x.sharding, piece))
    return jax.tree.unflatten(treedef, out), header.get("loader"), header.get("extra")
