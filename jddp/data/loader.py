"""A Grain-based loader that reads only this process's slice of each global batch.

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
import json
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh

from jddp import runtime, validate
from jddp.data import sampler as sampler_lib
from jddp.runtime import dispatch, distributed, host, packing, progress, watchdog

Example = dict[str, np.ndarray]
Transform = Callable[[Example, np.random.Generator], Example]


# Batches per Grain element on the fast path: enough to amortise Grain's
# per-element cost (and, with workers, one IPC transfer), bounded in bytes;
# other sources and transforms read one batch per element.
_READ_BYTES = 1 << 20
_MAX_BATCHES_PER_READ = 16
# Grain workers hand back arrays below this size pickled through their queue,
# larger ones in a fresh shared-memory segment each (Grain's default is 0: all
# through shared memory). A block of at most ~_READ_BYTES costs less pickled.
_MIN_SHM_BYTES = 2 * _READ_BYTES
# The read-ahead stream covers this many epochs past the current one (then restarts).
_EPOCHS_AHEAD = 1 << 20
# Room for one process's loader settings as JSON in the all-gather that compares them.
_SETTINGS_BYTES = 512


class _ReadBatch:
    """Reads runs of consecutive local batches as packed blocks; pickled into Grain worker processes.

    ``self(first)`` returns ``(first, block, layout)``: ``block`` is
    ``uint8[count, local_batch_size, row_bytes]`` holding the batches at
    positions ``first, ..., first + count - 1`` (``count`` up to
    ``batches_per_read``, never past the end of ``first``'s epoch), packed as
    ``jddp.runtime.packing`` describes. A dict of arrays without a per-example
    transform takes the fast path: the sampler computes all ``count`` slices at
    once and NumPy gathers each array straight into its place in the block.
    """

    def __init__(self, source, sampler, transform: Transform | None, batch_transform: Transform | None):
        self.source, self.sampler = source, sampler
        self.transform, self.batch_transform = transform, batch_transform
        self.arrays = _arrays(source) if transform is None and batch_transform is None else None
        self.source_mask: np.ndarray | None = None  # the source's own "mask", combined with the padding mask
        if self.arrays is not None:
            self.arrays = {k: _canonical(k, v) for k, v in self.arrays.items()}
            if "mask" in self.arrays:
                self.source_mask = _check_source_mask(self.arrays.pop("mask"), "the source")
        self.layout: tuple[packing.Field, ...] | None = None
        self.batches_per_read = self.row_bytes = 1
        if self.arrays is not None:
            fields = {k: (v.dtype, v.shape[1:]) for k, v in self.arrays.items()}
            self.layout, self.row_bytes = packing.layout_of({**fields, "mask": (np.dtype(np.float32), ())})
            batch_bytes = sampler.local_batch_size * self.row_bytes
            self.batches_per_read = int(np.clip(_READ_BYTES // batch_bytes, 1, _MAX_BATCHES_PER_READ))

    def __call__(self, first: int) -> tuple[int, np.ndarray, tuple[packing.Field, ...]]:
        first = int(first)
        per_epoch = len(self.sampler)
        count = min(self.batches_per_read, per_epoch - first % per_epoch)
        if self.arrays is None:  # one batch per read
            data, layout = packing.pack(self.batch(first))
            return first, data[None], layout
        layout = self.layout
        assert layout is not None  # __init__ sets it whenever self.arrays is set
        indices, mask, _ = self.sampler.local_block(first, count)
        block = np.empty((count, indices.shape[1], self.row_bytes), np.uint8)
        views = packing.host_views(block, layout)
        for name, array in self.arrays.items():
            np.take(array, indices, axis=0, out=views[name], mode="clip")  # indices are valid; "clip" is unbuffered
        views["mask"][...] = mask if self.source_mask is None else mask * self.source_mask[indices]
        return first, block, layout

    def batch(self, position: int) -> Example:
        """This process's batch at ``position`` as a dict of arrays, transforms applied."""
        local = self.sampler.local_batch(int(position))
        where = f"epoch {local.epoch}, loader position {local.position}, process rank {self.sampler.rank}"
        with _noted(
            lambda: f"reading examples {_listed(local.indices)} of the source of len {len(self.source)} ({where})"
        ):
            batch = read(self.source, local.indices)
        seed = self.sampler.seed
        if self.transform is not None:
            rows = [{k: v[i] for k, v in batch.items()} for i in range(len(local.indices))]
            rngs = [np.random.default_rng([seed, local.epoch, int(p)]) for p in local.order]
            out = []
            for index, row, rng in zip(local.indices, rows, rngs, strict=True):
                with _noted(lambda index=index: f"in `transform`, on example {index} of the source ({where})"):
                    out.append(self.transform(row, rng))
            batch = _stack(out)
        if self.batch_transform is not None:
            with _noted(lambda: f"in `batch_transform`, on examples {_listed(local.indices)} ({where})"):
                batch = self.batch_transform(batch, np.random.default_rng([seed, local.position, self.sampler.rank]))
        what = "the source" if self.transform is None and self.batch_transform is None else "the transforms"
        batch = {k: _canonical(k, np.asarray(v), what) for k, v in batch.items()}
        own = batch.pop("mask", None)
        batch["mask"] = local.mask if own is None else local.mask * _check_source_mask(own, what)
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


def _arrays(source) -> dict[str, np.ndarray] | None:
    """The source as a dict of NumPy arrays, or None."""
    if isinstance(source, np.ndarray):
        source = {"x": source}
    if not isinstance(source, Mapping) or not all(isinstance(v, np.ndarray) for v in source.values()):
        return None
    return dict(source)


# What the devices take, as ``jnp.asarray`` does without x64: 64-bit numbers become 32-bit.
_NARROW = {
    np.dtype(np.float64): np.float32,
    np.dtype(np.int64): np.int32,
    np.dtype(np.uint64): np.uint32,
    np.dtype(np.complex128): np.complex64,
}


def _canonical(name: str, array: np.ndarray, what: str = "the source") -> np.ndarray:
    """``array`` in a dtype the devices take (64-bit narrowed unless x64 is on); strings and objects refused."""
    dtype = array.dtype
    if not validate.goes_to_device(dtype):
        raise TypeError(
            f"DataLoader field {name!r} of {what} has dtype {dtype} ({_KINDS[dtype.kind]}): only numbers and "
            "bools can go to the devices. Encode it as numbers (e.g. integer ids), drop it from the source, or "
            "turn it into numbers in `transform`."
        )
    if (validate.bits(dtype) or 8) % 8:
        raise TypeError(
            f"DataLoader field {name!r} of {what} has dtype {dtype}, of {validate.bits(dtype)} bits a value: the "
            "loader moves whole bytes. Store it as int8/uint8 (or a float8 type) and cast it in the step."
        )
    narrow = _NARROW.get(dtype)
    if narrow is None or jax.config.read("jax_enable_x64"):
        return array
    return array.astype(narrow)


class DtypeWarning(UserWarning):
    """The loader narrowed 64-bit source fields to the 32-bit types the devices use (said once per field)."""


_SAID: set[tuple[str, str]] = set()


def _say_narrowed(said: dict[str, str]) -> None:
    new = {k: v for k, v in said.items() if (k, v) not in _SAID}  # once per process
    _SAID.update(new.items())
    if new:
        fields = ", ".join(f"{k!r} {v}" for k, v in new.items())
        warnings.warn(
            f"DataLoader: source fields {fields}, as jnp.asarray does without jax_enable_x64 (NumPy's default is "
            "64-bit; the devices compute in 32-bit). Convert the source yourself to silence this.",
            DtypeWarning,
            stacklevel=3,
        )


_KINDS = {"O": "Python objects", "U": "strings", "S": "bytes", "V": "raw records", "M": "datetimes", "m": "timedeltas"}


def _check_source_mask(mask: np.ndarray, what: str) -> np.ndarray:
    """A source's own ``mask`` (0 to leave an example out) as float32, checked: 0/1 per example."""
    mask = np.asarray(mask)
    if mask.ndim != 1:
        raise ValueError(
            f"The 'mask' field of {what} must be 0/1 per example (shape [N]), got shape {mask.shape}. It is "
            "combined with the padding mask; name a mask of another shape otherwise (e.g. 'token_mask')."
        )
    bad = mask[(mask != 0) & (mask != 1)]
    if bad.size:
        raise ValueError(f"The 'mask' field of {what} must be 0 or 1, got {bad[0].item()!r} among its values.")
    return mask.astype(np.float32)


def read(source, indices: np.ndarray) -> Example:
    """Rows ``indices`` of ``source`` as a dict of stacked arrays.

    A dict of arrays (or one array, keyed ``"x"``) is read with one fancy index
    per key; any other random-access source (a Grain data source, a sequence
    of dicts) record by record.
    """
    if isinstance(source, np.ndarray):
        return {"x": source[indices]}
    if isinstance(source, Mapping):
        return {k: np.asarray(v)[indices] for k, v in source.items()}
    records = [source[int(i)] for i in indices]
    for i, r in zip(indices, records, strict=True):
        if isinstance(r, tuple):
            raise TypeError(
                f"Example {int(i)} of the source is a tuple of {len(r)} (PyTorch's `(features, label)`); jddp's "
                "batches are dicts, so a record must be a dict of arrays (or one array, read as 'x'): return "
                "{'x': features, 'y': label} from the source's __getitem__, or pass the columns as a dict of arrays."
            )
    return _stack([r if isinstance(r, Mapping) else {"x": r} for r in records])


class _FirstPosition:
    """Block index -> position of its first batch, for blocks that never cross an epoch boundary."""

    def __init__(self, start: int, per_epoch: int, per_read: int):
        self.start, self.per_epoch, self.per_read = start, per_epoch, per_read
        self.blocks_per_epoch = -(-per_epoch // per_read)
        self.blocks_in_first_epoch = -(-(per_epoch - start % per_epoch) // per_read)

    def __call__(self, block: int) -> int:
        if block < self.blocks_in_first_epoch:
            return self.start + block * self.per_read
        epoch, j = divmod(block - self.blocks_in_first_epoch, self.blocks_per_epoch)
        return (self.start // self.per_epoch + 1 + epoch) * self.per_epoch + j * self.per_read


def _close_box(box: list) -> None:
    iterator, box[0] = box[0], None
    if iterator is not None:
        _close(iterator)


def _close(iterator) -> None:
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def _absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags; outside ``absl.app.run`` nobody parsed them."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _stack(rows: list[Mapping[str, Any]]) -> Example:
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


def _global_batch_size(global_batch_size: Any, per_device_batch_size: Any, devices: int) -> int:
    """The global batch size from exactly one of the two arguments."""
    if (global_batch_size is None) == (per_device_batch_size is None):
        which = "both" if global_batch_size is not None else "neither"
        raise ValueError(
            f"DataLoader needs exactly one of `global_batch_size` (examples per step over all devices) and "
            f"`per_device_batch_size` (examples per device, PyTorch DDP's batch_size), got {which}: "
            f"global_batch_size={global_batch_size!r}, per_device_batch_size={per_device_batch_size!r}. Pass one, "
            f"e.g. per_device_batch_size=4 for global_batch_size={4 * devices} on these {devices} devices."
        )
    if per_device_batch_size is None:
        return global_batch_size
    validate.check_int(
        "per_device_batch_size",
        per_device_batch_size,
        fix=f"It is multiplied by the {devices} devices of the mesh into the global batch size.",
    )
    return int(per_device_batch_size) * devices


def split_batch(global_batch_size: int, devices: int, max_per_device: int | None) -> tuple[int, int]:
    """``(accumulate_steps, padded_batch_size)`` for ``global_batch_size`` examples on ``devices`` devices that
    take at most ``max_per_device`` rows per micro-batch (None: no limit, no padding).

    Example:
      >>> split_batch(256, 3, 32), split_batch(256, 4, 32), split_batch(256, 4, None)
      ((3, 261), (2, 256), (1, 256))
    """
    if max_per_device is None:
        return 1, int(global_batch_size)
    global_batch_size, max_per_device = int(global_batch_size), int(max_per_device)
    k = -(-global_batch_size // (devices * max_per_device))
    micro = -(-global_batch_size // (devices * k))
    return k, devices * k * micro


def check_accumulate_steps(loader: DataLoader, accumulate_steps: int) -> None:
    """Raises unless a loader built with ``max_per_device_batch_size`` and the ``DataParallel`` (whose
    ``accumulate_steps`` is given) agree on the micro-batches: once, before a step (``jddp.fit``)."""
    if loader.max_per_device_batch_size is not None and loader.accumulate_steps != accumulate_steps:
        raise ValueError(
            f"The DataLoader splits each step into accumulate_steps={loader.accumulate_steps} micro-batches "
            f"(max_per_device_batch_size={loader.max_per_device_batch_size} rows on "
            f"{loader.padded_batch_size // loader.per_device_batch_size} devices), but the DataParallel has "
            f"accumulate_steps={accumulate_steps}. Build it with DataParallel(..., "
            "accumulate_steps=loader.accumulate_steps)."
        )


class DataLoader:
    """Global batches for ``DataParallel.step``, each process reading only its slice.

    The order of examples comes from a ``DistributedBatchSampler`` (world-size
    invariant, see ``jddp.data.sampler``); Grain runs the reads and transforms,
    in worker processes if asked, and prefetches; each yielded batch is a
    mapping of the source's keys plus ``"mask"`` (0 for padding) to global
    arrays with leading axis of size ``padded_batch_size`` (``global_batch_size``
    unless ``max_per_device_batch_size`` pads it), sharded over ``"data"``: a
    ``jddp.runtime.packing.PackedBatch``, one byte array on the devices that
    ``DataParallel`` unpacks inside its step.

    Iterating gives the batches from the current position to the end of its
    epoch, as iterating a PyTorch ``DataLoader`` does; iterate again for the
    next epoch. ``get_state()``/``set_state()`` save and restore the position,
    also onto a different number of processes or devices.

    Iterating consumes: every batch handed out advances the position (what
    ``get_state()`` saves and a resumed run continues from), in any loop, not
    only in ``fit``. So ``next(iter(loader))`` takes the epoch's first batch
    away from the training that follows. To look at a batch without moving,
    use ``loader.to_global(next(iter(loader.local_batches())))``
    (``local_batches`` leaves the position where it is), or save
    ``get_state()`` and ``set_state()`` it back.

    Args:
      source: a dict of equally long arrays, one array (yielded as ``"x"``), or
        any random-access source with ``len`` and ``[i]`` (a Grain data source).
      global_batch_size: examples per step over all processes; divisible by the
        number of devices of ``mesh``, unless ``max_per_device_batch_size`` is set.
      per_device_batch_size: instead of ``global_batch_size`` (exactly one of
        the two): examples per device and step, PyTorch DDP's ``batch_size``;
        the global batch size is ``per_device_batch_size`` x the devices of
        ``mesh`` (``jax.device_count()`` for ``jddp.data_mesh()``). Both are
        attributes of the loader; the attribute ``per_device_batch_size`` is
        the rows each device takes per step (``padded_batch_size`` / devices,
        padding included, over all its micro-batches).
      max_per_device_batch_size: the most rows a device takes in one
        micro-batch, for a global batch that must stay the same on any number
        of devices (an elastic run). The loader then sets
        ``accumulate_steps = ceil(B / (D * max))`` for ``B`` examples on ``D``
        devices, micro-batches of ``m = ceil(B / (D * accumulate_steps))``
        rows, and pads each global batch to ``padded_batch_size = D *
        accumulate_steps * m`` rows (the extra rows masked; the real examples
        keep their places). Pass
        ``DataParallel(..., accumulate_steps=loader.accumulate_steps)``. None:
        no padding, ``accumulate_steps`` is 1 (choose your own in
        ``DataParallel``).
      mesh: where batches go; ``jddp.data_mesh()`` when None.
      shuffle, seed, drop_last: as for ``DistributedBatchSampler``.
      transform: ``transform(example, rng) -> example`` per example; ``rng`` is
        a NumPy Generator seeded by (seed, epoch, place in the global order), so
        results do not depend on the number of processes.
      batch_transform: ``batch_transform(batch, rng) -> batch`` on this
        process's slice; ``rng`` is seeded by (seed, position, process).
      worker_count: Grain worker processes (0 reads in this process; workers
        need the ``if __name__ == "__main__":`` guard).
      prefetch: batches read ahead, by a thread (0 workers) or per worker,
        rounded up to whole blocks (a dict of arrays is read up to 16 batches at
        a time); 0 reads in the training thread when the next block is due.
        Reading ahead runs on into the next epoch: the workers and the thread
        live until ``close()`` or until the loader is garbage collected.

    Raises:
      ValueError: for an empty source, or a batch the devices cannot split
        without ``max_per_device_batch_size``.

    Example:
      >>> import numpy as np, jddp
      >>> loader = jddp.data.DataLoader({"x": np.arange(20, dtype=np.float32)}, global_batch_size=8, shuffle=False,
      ...                               drop_last=False)
      >>> [b["mask"].sum().item() for b in loader], loader.get_state()["epoch"]
      ([8.0, 8.0, 4.0], 1)
    """

    def __init__(
        self,
        source,
        *,
        global_batch_size: int | None = None,
        per_device_batch_size: int | None = None,
        max_per_device_batch_size: int | None = None,
        mesh: Mesh | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        transform: Transform | None = None,
        batch_transform: Transform | None = None,
        worker_count: int = 0,
        prefetch: int = 2,
    ):
        distributed.check_joined()
        size = source_size(source)
        if size == 0:
            raise ValueError("The source is empty (len(source)=0); a DataLoader needs at least one example.")
        mesh = runtime.data_mesh() if mesh is None else mesh
        if not isinstance(mesh, Mesh) or runtime.DATA_AXIS not in mesh.axis_names:
            raise TypeError(
                f"`mesh` must be a jax.sharding.Mesh with an axis named {runtime.DATA_AXIS!r} (jddp.data_mesh()), "
                f"got {mesh!r}."
            )
        devices = mesh.devices.size
        global_batch_size = _global_batch_size(global_batch_size, per_device_batch_size, devices)
        validate.check_int(
            "max_per_device_batch_size",
            max_per_device_batch_size,
            optional=True,
            fix="It is the most rows a device takes in one micro-batch; None for no limit.",
        )
        if max_per_device_batch_size is None and isinstance(global_batch_size, int) and global_batch_size % devices:
            raise ValueError(
                f"`global_batch_size` must be divisible by the number of devices (processes x local "
                f"devices), got global_batch_size={global_batch_size}, processes={jax.process_count()}, "
                f"devices={devices}. Use a multiple of {devices}, or, for a global batch that must stay the same "
                "on any number of devices, pass `max_per_device_batch_size` (the most rows a device takes in one "
                "micro-batch): the loader then pads the batch with masked rows and sets `loader.accumulate_steps` "
                "for DataParallel."
            )
        validate.check_int("worker_count", worker_count, minimum=0)
        validate.check_int("prefetch", prefetch, minimum=0)
        validate.check_bool("shuffle", shuffle)
        validate.check_bool("drop_last", drop_last)
        for name, fn, form in (
            ("transform", transform, "transform(example, rng) -> example"),
            ("batch_transform", batch_transform, "batch_transform(batch, rng) -> batch"),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"`{name}` must be a function {form}, or None, got {name}={fn!r:.80}.")
        validate.check_int("global_batch_size", global_batch_size)
        accumulate_steps, padded = split_batch(global_batch_size, devices, max_per_device_batch_size)
        if drop_last and size < global_batch_size:
            raise ValueError(
                f"`source` is smaller than one global batch with `drop_last=True`: dataset_size={size}, "
                f"global_batch_size={global_batch_size}, so an epoch has no batch. Use a smaller batch or "
                "drop_last=False (the batch is then padded with masked entries), or check `source`: len(source) is "
                f"{size}."
            )
        self.sampler = sampler_lib.DistributedBatchSampler(
            size,
            global_batch_size=global_batch_size,
            num_replicas=jax.process_count(),
            rank=jax.process_index(),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            padded_batch_size=padded,
        )
        self.source, self.mesh = source, mesh
        self.global_batch_size: int = self.sampler.global_batch_size  # real examples per step, all devices together
        self.padded_batch_size: int = padded  # rows per step (the arrays' leading axis): examples, then padding
        self.per_device_batch_size: int = padded // devices  # rows per device and step, over its micro-batches
        self.max_per_device_batch_size = max_per_device_batch_size
        self.accumulate_steps: int = accumulate_steps  # for DataParallel(accumulate_steps=...)
        self.worker_count, self.prefetch = worker_count, prefetch
        self._read = _ReadBatch(source, self.sampler, transform, batch_transform)
        if transform is None and batch_transform is None:  # what the devices will get, said now, not at a step
            fields = _arrays(source) or read(source, np.zeros(1, np.int64))
            narrowed = {k: (v.dtype, _canonical(k, v[:1]).dtype) for k, v in fields.items() if k != "mask"}
            _say_narrowed({k: f"{a} -> {b}" for k, (a, b) in narrowed.items() if a != b})
        self._sharding = runtime.batch_sharding(mesh)
        self._transfer = packing.Transfer(self._sharding, padded)
        # The stream sits in a box that a finalizer closes when the loader goes
        # away or at exit, before the interpreter tears down what Grain's own
        # cleanup needs.
        self._box: list[Iterator | None] = [None]
        weakref.finalize(self, _close_box, self._box)
        self._stream_position, self._rows, self._layout = -1, iter(()), ()
        self._agreed = False  # settings compared across processes at the first batch (a collective)

    def __len__(self) -> int:
        """Global batches per epoch."""
        return len(self.sampler)

    def steps(self, epochs: float) -> int:
        """Training steps (global batches) in ``epochs`` epochs: for ``Checkpointer(save_every=...)``, ``fit``'s
        ``eval_every`` and the other ``*_every`` settings, which count steps, where a PyTorch script counts epochs.

        Raises:
          ValueError: ``epochs`` not a positive finite number, or fewer than one step.

        Example:
          >>> import numpy as np, jddp
          >>> loader = jddp.data.DataLoader({"x": np.zeros((160, 3), np.float32)}, global_batch_size=16, seed=0)
          >>> loader.steps(epochs=2), loader.steps(epochs=0.5)
          (20, 5)
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int | float) or not np.isfinite(epochs) or epochs <= 0:
            raise ValueError(
                f"`epochs` must be a positive number of epochs, got epochs={epochs!r}; for example "
                f"loader.steps(epochs=2) is {2 * len(self)} steps of this loader."
            )
        steps = round(epochs * len(self))
        if steps < 1:
            raise ValueError(
                f"epochs={epochs!r} is less than one step of this loader ({len(self)} steps per epoch); use at least "
                f"epochs={1 / len(self):.3g}."
            )
        return steps

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedBatchSampler.set_epoch``; optional, the position implies the epoch."""
        self.sampler.set_epoch(epoch)

    def skip(self, batches: int, *, timeout_s: float = 300.0) -> None:
        """Skips the next ``batches`` global batches and records it in the state: ``examples_at`` and a resumed
        run account for it (see ``DistributedBatchSampler.skip``).

        In a group every process must call it at the same point with the same ``batches``: the calls are agreed
        (``jddp.host_all_gather``) before anything moves.

        Raises:
          ValueError: ``batches`` is not a positive int; on every process, when the processes ask for different
            skips or stand at different positions, naming each one's.
          TimeoutError: after ``timeout_s``, naming the processes that did not call.
        """
        sampler_lib.check_skip(batches)
        validate.check_number("timeout_s", timeout_s, unit="seconds")
        if jax.process_count() > 1:
            asked = host.host_all_gather((self.sampler.position, batches), timeout_s=timeout_s)
            if len(set(asked)) > 1:
                listed = ", ".join(f"process {i}: position {p}, skip {n}" for i, (p, n) in enumerate(asked))
                raise ValueError(
                    f"DataLoader.skip: the processes differ ({listed}). Call skip on every process at the same "
                    "point with the same number, e.g. from the run's config (jddp.fit's skip_steps does)."
                )
        self.sampler.skip(batches)

    def examples_at(self, step: int) -> np.ndarray:
        """The dataset indices of the real examples of training step ``step``'s global batch (all processes')."""
        return self.sampler.examples_at(step)

    def get_state(self) -> dict[str, Any]:
        """The position in the global sequence, JSON-able and independent of the process count."""
        return self.sampler.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from ``state``; raises ``ValueError`` for another data setup."""
        self.sampler.load_state_dict(state)

    def _pipeline(self, start: int, epochs: int) -> grain.IterDataset:
        """Grain pipeline of packed blocks from position ``start`` to the end of ``epochs`` more epochs.

        Each element is ``_ReadBatch``'s block of up to ``batches_per_read``
        batches, read (and transformed) in Grain workers when ``worker_count``
        > 0 and read ahead by a thread when ``prefetch`` > 0.
        """
        first = _FirstPosition(start, len(self.sampler), self._read.batches_per_read)
        blocks = first.blocks_in_first_epoch + epochs * first.blocks_per_epoch
        dataset = grain.MapDataset.range(blocks).map(first).map(self._read)
        it = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        ahead = -(-self.prefetch // self._read.batches_per_read)  # in blocks, rounded up
        if self.worker_count:
            _absl_flags_parsed()
            shm = grain.experimental.DatasetOptions(min_shm_size=_MIN_SHM_BYTES)
            it = grain.experimental.WithOptionsIterDataset(it, shm)
            options = grain.MultiprocessingOptions(self.worker_count, per_worker_buffer_size=max(ahead, 1))
            it = it.mp_prefetch(options)
        elif ahead:
            it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=ahead)
        return it

    def local_batches(self) -> Iterator[Example]:
        """This process's NumPy slices from the position to the end of the epoch (position not advanced)."""
        iterator = iter(self._pipeline(self.sampler.position, epochs=0))
        try:
            for _, block, layout in iterator:
                for data in block:
                    yield packing.host_views(data, layout)
        finally:
            _close(iterator)

    def __iter__(self) -> Iterator[packing.PackedBatch]:
        if not self._agreed:
            self._agree()
        end = (self.sampler.epoch + 1) * len(self.sampler)
        while self.sampler.position < end:
            with progress.phase("data"):
                data, layout = self._next_local()
                batch = packing.PackedBatch(self._transfer(data), layout)
            self.sampler.position += 1  # consumed once handed out: a save now resumes after it
            yield batch

    def _agree(self) -> None:
        """At the first batch of a group: every process built this loader the same way, or a ``ValueError``.

        One all-gather of each process's settings (as JSON). Processes that disagree would read overlapping
        slices of different orders: examples duplicated and dropped without an error (``seed=process_index()``
        duplicates and drops 14 of 64 per epoch).
        """
        self._agreed = True
        if jax.process_count() == 1:
            return
        from jax.experimental import multihost_utils

        s = self.sampler
        mine = {
            "dataset size": s.dataset_size,
            "global_batch_size": s.global_batch_size,
            "padded_batch_size": s.padded_batch_size,
            "seed": s.seed,
            "shuffle": s.shuffle,
            "drop_last": s.drop_last,
            "position": s.position,
        }
        text = json.dumps(mine).encode()[:_SETTINGS_BYTES]
        row = np.zeros(_SETTINGS_BYTES, np.uint8)
        row[: len(text)] = np.frombuffer(text, np.uint8)
        dispatch.DISPATCHER.drain()  # no other program with collectives in flight
        with watchdog.waiting():
            rows = np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), _SETTINGS_BYTES)
        every = [json.loads(bytes(r).rstrip(b"\0")) for r in rows]
        for key in mine:
            values = [e.get(key) for e in every]
            if len({json.dumps(v) for v in values}) > 1:
                listed = ", ".join(f"{v!r} on process {i}" for i, v in enumerate(values))
                hint = (
                    " Do not derive the seed from the process index: the loader already gives each process its "
                    "own slice of one global order."
                    if key == "seed"
                    else ""
                )
                raise ValueError(
                    f"The DataLoaders of this run's processes differ in {key}: {listed}. Every process must build "
                    "its loader with the same source size, global_batch_size, max_per_device_batch_size, seed, "
                    "shuffle and drop_last, and restore the same position, or examples are duplicated and "
                    f"dropped.{hint}"
                )

    def _next_local(self) -> tuple[np.ndarray, tuple[packing.Field, ...]]:
        """The local rows at the sampler's position, from one stream that runs on across epochs.

        Grain workers and read-ahead therefore live as long as the loader
        instead of restarting every epoch (a worker start is seconds of
        imports). The stream restarts only when the position moved
        (``set_state``, ``set_epoch``) or a read failed.
        """
        if self._box[0] is None or self._stream_position != self.sampler.position:
            self.close()
            self._box[0] = iter(self._pipeline(self.sampler.position, epochs=_EPOCHS_AHEAD))
            self._stream_position, self._rows = self.sampler.position, iter(())
        row = next(self._rows, None)
        if row is None:
            try:
                first, block, self._layout = next(self._box[0])
            except BaseException:
                self.close()
                raise
            assert first == self._stream_position, (first, self._stream_position)
            self._rows = iter(block)
            row = next(self._rows)
        self._stream_position += 1
        return row, self._layout

    def _checked_local(self, local: Any) -> Example:
        """``local`` as ``to_global`` packs it: NumPy arrays in the dtypes the devices take, or an error naming it."""
        what = "what local_batches() yields: a dict of arrays with one row per example"
        if not isinstance(local, Mapping):
            raise TypeError(f"`local` must be {what}, got {type(local).__name__}.")
        if not local:
            raise ValueError(f"`local` must be {what}, got an empty mapping.")
        arrays = {}
        for key, value in local.items():
            if isinstance(value, jax.Array) and value.is_deleted():
                raise ValueError(
                    f"`local` holds a deleted jax.Array at {key!r} (donated to a step?); pass live arrays."
                )
            if not isinstance(value, np.ndarray | jax.Array) or value.ndim == 0:
                shown = f"shape {value.shape}" if hasattr(value, "shape") else type(value).__name__
                raise TypeError(f"`local` must be {what}, got {shown} at {key!r}.")
            arrays[str(key)] = _canonical(str(key), np.asarray(value), "`local`")
        rows = {k: len(v) for k, v in arrays.items()}
        if set(rows.values()) != {self.sampler.local_batch_size}:
            raise ValueError(
                f"`local` must hold this process's {self.sampler.local_batch_size} rows in every array "
                f"(padded_batch_size={self.padded_batch_size} over {self.sampler.num_replicas} process(es)), got "
                f"rows {rows}."
            )
        return arrays

    def close(self) -> None:
        """Stops the read-ahead stream and its Grain workers; iterating again starts a new one."""
        _close_box(self._box)

    def to_global(self, local: Example) -> packing.PackedBatch:
        """This process's rows as one global batch sharded over ``"data"``.

        The arrays travel packed into one byte array (one buffer per device
        instead of one per array and device; see ``jddp.runtime.packing``).

        Args:
          local: what ``local_batches`` yields: a dict of arrays of this process's ``global_batch_size /
            process_count`` rows each, numbers or bools.

        Raises:
          TypeError: ``local`` is not a dict of arrays, or holds strings or objects.
          ValueError: ``local`` is empty, an array is deleted or has no rows, or the row counts are not this
            process's share of the global batch.
        """
        local = self._checked_local(local)
        data, layout = packing.pack(local)
        return packing.PackedBatch(self._transfer(data), layout)
