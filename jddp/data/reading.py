"""Reads this process's batches from a source: runs of consecutive batches packed into one block, transforms applied.

Where the host CPU goes, per batch (200k x 40 float32 source, global batch
256, 8 simulated devices; ``benchmarks/loader_throughput.py``): a dict of
arrays is read in blocks of up to 16 batches per Grain element. For a block,
the sampler computes every slice in one NumPy expression and ``np.take``
gathers each array straight into its aligned field of one packed
``uint8[batches, rows, row_bytes]`` buffer; each batch then goes to the devices
in one direct ``batched_device_put``. That is about 60 µs of CPU per batch,
where reading batch by batch (Grain element, sampler slice, fancy index, pack,
``jax.device_put``) took about 280 µs. On simulated devices the training step
runs on the same cores, so every microsecond here is a microsecond of step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jddp.data import buckets as buckets_lib
from jddp.data import fields as fields_lib
from jddp.runtime import packing

Transform = Callable[[fields_lib.Example, np.random.Generator], fields_lib.Example]


# Batches per Grain element on the fast path: enough to amortise Grain's
# per-element cost (and, with workers, one IPC transfer), bounded in bytes;
# other sources and transforms read one batch per element.
READ_BYTES = 1 << 20
_MAX_BATCHES_PER_READ = 16


class ReadBatch:
    """Reads runs of consecutive local batches as packed blocks; pickled into Grain worker processes.

    ``self(first)`` returns ``(first, block, layout)``: ``block`` is
    ``uint8[count, local_batch_size, row_bytes]`` holding the batches at
    positions ``first, ..., first + count - 1`` (``count`` up to
    ``batches_per_read``, never past the end of ``first``'s epoch), packed as
    ``jddp.runtime.packing`` describes. A dict of arrays without a per-example
    transform takes the fast path: the sampler computes all ``count`` slices at
    once and NumPy gathers each array straight into its place in the block.

    With a ``jddp.data.buckets.BucketedBatchSampler`` every read is one batch (batches of other buckets have other
    shapes): the fields of ``Buckets.pad`` are cut or padded to the batch's boundary.
    """

    def __init__(self, source, sampler, transform: Transform | None, batch_transform: Transform | None):
        self.source, self.sampler = source, sampler
        self.transform, self.batch_transform = transform, batch_transform
        self.buckets: buckets_lib.Buckets | None = getattr(sampler, "buckets", None)
        self.arrays = arrays(source) if transform is None and batch_transform is None else None
        self.source_mask: np.ndarray | None = None  # the source's own "mask", combined with the padding mask
        if self.arrays is not None:
            self.arrays = {k: fields_lib.canonical(k, v) for k, v in self.arrays.items()}
            if "mask" in self.arrays:
                self.source_mask = fields_lib.check_source_mask(self.arrays.pop("mask"), "the source")
        self.layout: tuple[packing.Field, ...] | None = None
        self.layouts: dict[int, tuple[tuple[packing.Field, ...], int]] = {}  # per bucket boundary
        self.pads: dict[str, np.ndarray] = {}
        self.batches_per_read = self.row_bytes = 1
        if self.arrays is not None:
            fields = {k: (v.dtype, v.shape[1:]) for k, v in self.arrays.items()}
            self.layout, self.row_bytes = packing.layout_of({**fields, "mask": (np.dtype(np.float32), ())})
            batch_bytes = sampler.local_batch_size * self.row_bytes
            self.batches_per_read = int(np.clip(READ_BYTES // batch_bytes, 1, _MAX_BATCHES_PER_READ))
            if self.buckets is not None:
                self.batches_per_read, self.pads = 1, _array_pads(self.arrays, self.buckets, sampler.lengths)
                for b in self.buckets.boundaries:
                    shapes = {k: (d, (b, *s[1:]) if k in self.pads else s) for k, (d, s) in fields.items()}
                    self.layouts[b] = packing.layout_of({**shapes, "mask": (np.dtype(np.float32), ())})

    def __call__(self, first: int) -> tuple[int, np.ndarray, tuple[packing.Field, ...]]:
        first = int(first)
        per_epoch = len(self.sampler)
        count = min(self.batches_per_read, per_epoch - first % per_epoch)
        if self.arrays is None:  # one batch per read
            data, layout = packing.pack(self.batch(first))
            return first, data[None], layout
        layout, row_bytes, boundary = self.layout, self.row_bytes, None
        if self.buckets is not None:
            boundary = self.sampler.boundary_at(first)
            layout, row_bytes = self.layouts[boundary]
        assert layout is not None  # __init__ sets it whenever self.arrays is set
        indices, mask, _ = self.sampler.local_block(first, count)
        block = np.empty((count, indices.shape[1], row_bytes), np.uint8)
        views = packing.host_views(block, layout)
        for name, array in self.arrays.items():
            if name in self.pads:  # bucketed: one batch, cut or padded to its boundary
                rows = np.take(array[:, :boundary], indices[0], axis=0)
                buckets_lib.fill(views[name][0], rows, self.sampler.lengths[indices[0]], self.pads[name])
                continue
            np.take(array, indices, axis=0, out=views[name], mode="clip")  # indices are valid; "clip" is unbuffered
            if self.buckets is not None and name == self.buckets.length:  # cut with too_long="truncate"
                views[name][...] = np.minimum(views[name], self.sampler.lengths[indices])
        views["mask"][...] = mask if self.source_mask is None else mask * self.source_mask[indices]
        return first, block, layout

    def batch(self, position: int) -> fields_lib.Example:
        """This process's batch at ``position`` as a dict of arrays, transforms applied."""
        local = self.sampler.local_batch(int(position))
        where = f"epoch {local.epoch}, loader position {local.position}, process rank {self.sampler.rank}"
        with _noted(
            lambda: f"reading examples {_listed(local.indices)} of the source of len {len(self.source)} ({where})"
        ):
            rows = read_rows(self.source, local.indices) if self.buckets is not None else None
            batch = read(self.source, local.indices) if rows is None else {}
        seed = self.sampler.seed
        if self.transform is not None:
            rows = rows if rows is not None else [{k: v[i] for k, v in batch.items()} for i in range(len(local.mask))]
            rngs = [np.random.default_rng([seed, local.epoch, int(p)]) for p in local.order]
            out = []
            for index, row, rng in zip(local.indices, rows, rngs, strict=True):
                with _noted(lambda index=index: f"in `transform`, on example {index} of the source ({where})"):
                    out.append(self.transform(row, rng))
            rows, batch = out, ({} if self.buckets is not None else _stack(out))
        if self.buckets is not None and rows is not None:
            lengths, boundary = self.sampler.lengths[local.indices], self.sampler.boundary_at(local.position)
            with _noted(lambda: f"padding examples {_listed(local.indices)} to length {boundary} ({where})"):
                batch = buckets_lib.pad_rows(rows, lengths, boundary, self.buckets, local.indices)
        if self.batch_transform is not None:
            with _noted(lambda: f"in `batch_transform`, on examples {_listed(local.indices)} ({where})"):
                batch = self.batch_transform(batch, np.random.default_rng([seed, local.position, self.sampler.rank]))
        what = "the source" if self.transform is None and self.batch_transform is None else "the transforms"
        batch = {k: fields_lib.canonical(k, np.asarray(v), what) for k, v in batch.items()}
        own = batch.pop("mask", None)
        batch["mask"] = local.mask if own is None else local.mask * fields_lib.check_source_mask(own, what)
        return batch


@contextlib.contextmanager
def _noted(where: Callable[[], str]):
    """Adds ``jddp.DataLoader: raised <where>`` to an error of the user's source or transforms (its type and
    traceback stay); Grain's worker processes pass the note on with the error."""
    try:
        yield
    except Exception as error:
        error.add_note(f"jddp.DataLoader: raised {where()}")
        raise


def _listed(indices: np.ndarray, limit: int = 8) -> str:
    shown = ", ".join(str(int(i)) for i in indices[:limit])
    return f"[{shown}{', ...' if len(indices) > limit else ''}]"


def arrays(source) -> dict[str, np.ndarray] | None:
    """The source as a dict of NumPy arrays, or None."""
    if isinstance(source, np.ndarray):
        source = {"x": source}
    if not isinstance(source, Mapping) or not all(isinstance(v, np.ndarray) for v in source.values()):
        return None
    return dict(source)


def read_rows(source, indices: np.ndarray) -> list[fields_lib.Example]:
    """Rows ``indices`` of ``source``, one dict per example (arrays of any shape: not yet stacked)."""
    if isinstance(source, np.ndarray | Mapping):
        table = {"x": source} if isinstance(source, np.ndarray) else source
        return [{k: np.asarray(v)[int(i)] for k, v in table.items()} for i in indices]
    records = [source[int(i)] for i in indices]
    for i, r in zip(indices, records, strict=True):
        if isinstance(r, tuple):
            raise TypeError(
                f"Example {int(i)} of the source is a tuple of {len(r)} (PyTorch's `(features, label)`); jddp's "
                "batches are dicts, so a record must be a dict of arrays (or one array, read as 'x'): return "
                "{'x': features, 'y': label} from the source's __getitem__, or pass the columns as a dict of arrays."
            )
    return [
        {k: np.asarray(v) for k, v in r.items()} if isinstance(r, Mapping) else {"x": np.asarray(r)} for r in records
    ]


def lengths(source, buckets: buckets_lib.Buckets) -> np.ndarray:
    """Every example's length, as ``buckets.length`` says: a field of the source, or ``length_fn(example)``.

    A dict of arrays gives a field in one read; any other source is read example by example, once.

    Raises:
      ValueError: the field is missing, or a length is not an int, naming the example.
    """
    key, size = buckets.length, source_size(source)
    table = arrays(source)
    if isinstance(key, str) and table is not None:
        if key not in table:
            raise ValueError(f"`Buckets(length={key!r})` names no field of the source; its fields are {sorted(table)}.")
        return np.asarray(table[key])
    out = np.empty(size, np.int64)
    for i in range(size):
        (row,) = read_rows(source, np.array([i]))
        if isinstance(key, str) and key not in row:
            raise ValueError(
                f"`Buckets(length={key!r})` names no field of example {i} of the source; its fields are {sorted(row)}."
            )
        with _noted(lambda i=i: f"in `Buckets.length`, on example {i} of the source"):
            value = np.asarray(row[key] if isinstance(key, str) else key(row))
        if value.ndim or not np.issubdtype(value.dtype, np.integer):
            raise ValueError(
                f"The length of example {i} must be an int, got {value!r:.80} (dtype {value.dtype}); "
                "`Buckets.length` must name a field of ints or return an int."
            )
        out[i] = int(value)
    return out


def _array_pads(table: dict[str, np.ndarray], buckets: buckets_lib.Buckets, lengths: np.ndarray) -> dict:
    """Each padded field of a dict of arrays, checked (a sequence axis long enough), with its padding value."""
    pads = {}
    for name, value in buckets.pad.items():
        if name not in table:
            raise ValueError(f"`Buckets.pad` names field {name!r}, but the source's fields are {sorted(table)}.")
        array, longest = table[name], int(np.argmax(lengths))
        if array.ndim < 2 or array.shape[1] < lengths[longest]:
            raise ValueError(
                f"Field {name!r} of the source has shape {array.shape}: a padded field needs a sequence axis (its "
                f"second) of at least the longest length, {int(lengths[longest])} (example {longest}). Store it "
                "padded to the longest example, or give the source as records of unpadded arrays."
            )
        pads[name] = buckets_lib.pad_value(name, value, array.dtype)
    return pads


def read(source, indices: np.ndarray) -> fields_lib.Example:
    """Rows ``indices`` of ``source`` as a dict of stacked arrays.

    A dict of arrays (or one array, keyed ``"x"``) is read with one fancy index
    per key; any other random-access source (a Grain data source, a sequence
    of dicts) record by record.
    """
    if isinstance(source, np.ndarray):
        return {"x": source[indices]}
    if isinstance(source, Mapping):
        return {k: np.asarray(v)[indices] for k, v in source.items()}
    return _stack(read_rows(source, indices))


def _stack(rows: Sequence[Mapping[str, Any]]) -> fields_lib.Example:
    return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}


def source_size(source) -> int:
    """The number of examples of a source (the common leading size of a dict's arrays)."""
    if isinstance(source, Mapping):
        sizes = {k: len(v) for k, v in source.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"Every array of the source must have the same length, got {sizes}.")
        return next(iter(sizes.values()), 0)
    if isinstance(source, tuple) and source and all(hasattr(a, "shape") and len(a.shape) >= 1 for a in source):
        lengths = {int(a.shape[0]) for a in source}
        if len(lengths) == 1 and lengths != {len(source)}:
            raise TypeError(
                f"The source is a tuple of {len(source)} arrays of {lengths.pop()} rows each, which would be read as "
                f"{len(source)} examples. Pass the columns as a dict (PyTorch's TensorDataset(X, Y) is "
                "{'x': X, 'y': Y} here), or a list of records."
            )
    try:
        return len(source)
    except TypeError:
        raise TypeError(
            f"The source must support `len()` and indexing (a NumPy array, a dict of arrays or a Grain "
            f"data source), got {type(source).__name__}."
        ) from None
