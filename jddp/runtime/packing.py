"""A batch of several arrays packed into one byte array per transfer.

Copying a batch to the devices costs per buffer: on 8 simulated CPU devices a
dict of 3 arrays (24 buffers) took about 3x as long as the same bytes packed
into one uint8 array (8 buffers), and that cost competes with the training step
for the CPU. ``jddp.data.DataLoader`` therefore packs each local batch into one
``uint8[rows, row_bytes]`` array; ``DataParallel`` unpacks it inside the
compiled step, where it is a few fused slices and bitcasts.

``Transfer`` puts such an array onto the devices through JAX's C++
``batched_device_put`` directly (see its docstring for the measured saving).

A ``PackedBatch`` is also a read-only mapping: ``batch["x"]`` unpacks that one
field on the devices (a small jitted program), for code that looks at batches.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Mapping

import jax
import numpy as np
from jax import lax

from jddp.runtime import jax_internals


@dataclasses.dataclass(frozen=True)
class Field:
    """Where one array lives in a packed row: ``bytes[start:stop]``, as ``dtype[*shape]``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    stop: int


def layout_of(fields: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> tuple[tuple[Field, ...], int]:
    """The packed layout of one row holding ``{name: (dtype, shape)}``, and the row's size in bytes.

    Each field starts at a multiple of its item size and the row size is a
    multiple of the largest one, so NumPy views of the fields in a packed
    buffer are aligned (NumPy can then gather straight into them).
    """
    layout, offset, align = [], 0, 1
    for name, (dtype, shape) in fields.items():
        dtype = np.dtype(dtype)
        if dtype.hasobject:
            raise ValueError(f"Field {name!r} has dtype {dtype}; only numeric and bool arrays can be packed.")
        offset = -(-offset // dtype.itemsize) * dtype.itemsize
        size = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
        # ml_dtypes' types (bfloat16, float8): their ``str`` ("<V2", "<f1") loses them, their name does not
        name_of = dtype.name if dtype.type.__module__ == "ml_dtypes" else dtype.str
        layout.append(Field(name, name_of, tuple(int(d) for d in shape), offset, offset + size))
        offset += size
        align = max(align, dtype.itemsize)
    return tuple(layout), max(-(-offset // align) * align, 1)


def host_views(data: np.ndarray, layout: tuple[Field, ...]) -> dict[str, np.ndarray]:
    """NumPy views (no copies) of each field in ``data`` (``uint8[..., row_bytes]``, rows contiguous).

    Writing into a view writes the packed bytes; reading gives the arrays back.
    """
    lead = data.shape[:-1]
    return {f.name: data[..., f.start : f.stop].view(np.dtype(f.dtype)).reshape(*lead, *f.shape) for f in layout}


def pack(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, tuple[Field, ...]]:
    """Packs arrays with a common leading size into ``uint8[rows, row_bytes]`` and its layout."""
    rows = {len(v) for v in arrays.values()}
    if len(rows) != 1:
        raise ValueError(
            f"Packed arrays must share their leading size, got { {k: len(v) for k, v in arrays.items()} }."
        )
    (n,) = rows
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    layout, row_bytes = layout_of({k: (v.dtype, v.shape[1:]) for k, v in arrays.items()})
    data = np.zeros((n, row_bytes), np.uint8) if _has_gaps(layout, row_bytes) else np.empty((n, row_bytes), np.uint8)
    for name, view in host_views(data, layout).items():
        view[...] = arrays[name]
    return data, layout


def _has_gaps(layout: tuple[Field, ...], row_bytes: int) -> bool:
    """Whether alignment left padding bytes (zeroed, so packed bytes are deterministic)."""
    return sum(f.stop - f.start for f in layout) != row_bytes


def unpack(data: jax.Array, layout: tuple[Field, ...]) -> dict[str, jax.Array]:
    """The arrays of ``data`` (``uint8[rows, row_bytes]``), traceable under ``jit``/``shard_map``."""
    return {f.name: _field(data, f) for f in layout}


def _field(data: jax.Array, f: Field) -> jax.Array:
    dtype = np.dtype(f.dtype)
    raw = data[:, f.start : f.stop]
    n = data.shape[0]
    if dtype == np.bool_:
        return raw.reshape(n, *f.shape) != 0
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(raw, dtype).reshape(n, *f.shape)
    raw = raw.reshape(n, -1, dtype.itemsize)
    return lax.bitcast_convert_type(raw, dtype).reshape(n, *f.shape)


@functools.partial(jax.jit, static_argnums=1)
def _unpack_field(data: jax.Array, f: Field) -> jax.Array:
    return _field(data, f)


class PackedBatch(Mapping[str, jax.Array]):
    """A global batch as one ``uint8`` array plus its layout; a pytree with that one leaf.

    Attributes:
      data: ``uint8[global_batch_size, row_bytes]``, sharded like the batch.
      layout: the ``Field`` of each array.
    """

    def __init__(self, data: jax.Array, layout: tuple[Field, ...]):
        self.data, self.layout = data, tuple(layout)

    def __getitem__(self, name: str) -> jax.Array:
        for f in self.layout:
            if f.name == name:
                return _unpack_field(self.data, f)
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (f.name for f in self.layout)

    def __len__(self) -> int:
        return len(self.layout)

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.name}: {np.dtype(f.dtype).name}{list(f.shape)}" for f in self.layout)
        return f"PackedBatch(rows={self.data.shape[0]}, {fields})"


jax.tree_util.register_pytree_node(
    PackedBatch,
    lambda b: ((b.data,), b.layout),
    lambda layout, children: PackedBatch(children[0], layout),
)


class Transfer:
    """Puts this process's packed rows onto its devices as the global batch array.

    The same result as ``jax.make_array_from_process_local_data(sharding, rows,
    global_shape)`` (``jax.device_put`` in one process), at a fraction of the
    host CPU: measured on 8 simulated devices, about 70 µs per batch through
    ``jax.device_put``'s Python layers, about 15 µs straight through
    ``batched_device_put``, the C++ call those layers end in. On simulated
    devices the host CPU is what the training step runs on, so it counts. The
    direct call is private JAX API: if it is missing, or the local rows are not
    one contiguous block of the global batch, the public functions are used.
    """

    def __init__(self, sharding, global_rows: int):
        self.sharding, self.global_rows = sharding, global_rows
        self._put = None
        direct = jax_internals.batched_device_put()
        if direct is None:  # pragma: no cover - depends on the JAX version
            return
        self._put, self._aval = direct
        self._slices: dict[int, tuple[list, list[slice]] | None] = {}

    def _plan(self, row_bytes: int) -> tuple[list, list[slice]] | None:
        """Addressable devices and their rows of the local block, or None if not one contiguous block."""
        if row_bytes not in self._slices:
            index = self.sharding.addressable_devices_indices_map((self.global_rows, row_bytes))
            devices = list(index)
            rows = [index[d][0].indices(self.global_rows)[:2] for d in devices]
            offset = min(start for start, _ in rows)
            covered = sorted(rows)
            contiguous = all(a[1] == b[0] for a, b in itertools.pairwise(covered))
            full_columns = all(index[d][1] == slice(None) for d in devices)
            plan = None
            if contiguous and full_columns:
                plan = (devices, [slice(a - offset, b - offset) for a, b in rows])
            self._slices[row_bytes] = plan
        return self._slices[row_bytes]

    def __call__(self, data: np.ndarray) -> jax.Array:
        put = self._put
        plan = self._plan(data.shape[1]) if put is not None else None
        shape = (self.global_rows, data.shape[1])
        if plan is None or put is None:  # plan is None whenever put is
            if jax.process_count() == 1:
                return jax.device_put(data, self.sharding)
            return jax.make_array_from_process_local_data(self.sharding, data, shape)
        devices, rows = plan
        if rows[-1].stop > len(data):
            raise ValueError(f"Expected {rows[-1].stop} local rows for the batch, got {len(data)}.")
        return put(self._aval(shape, data.dtype), self.sharding, [data[r] for r in rows], devices, True)
