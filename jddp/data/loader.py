"""A Grain-based loader that reads only this process's slice of each global batch: ``DataLoader``.

Its parts live beside it: ``sizes`` (the global batch, its micro-batches and padding), ``reading`` (packed blocks
from the source, transforms applied), ``fields`` (what the devices take), ``pipeline`` (Grain workers and read-ahead
as one stream) and ``agreement`` (the processes' settings compared at the first batch).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jddp import runtime, validate
from jddp.data import agreement, fields, pipeline, reading, sizes
from jddp.data import buckets as buckets_lib
from jddp.data import sampler as sampler_lib
from jddp.runtime import distributed, host, packing, progress, standby


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
      buckets: ``jddp.data.Buckets(boundaries, length, pad)`` for variable-length examples: each global batch
        holds examples of one length bucket, its ``pad`` fields padded to the bucket's boundary, so a run has at
        most ``len(boundaries)`` batch shapes (one compiled step each); the batches stay world-size invariant
        (``jddp.data.buckets``). The lengths are read from the whole source when the loader is built. None: every
        example has the same shape.
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
        transform: reading.Transform | None = None,
        batch_transform: reading.Transform | None = None,
        buckets: buckets_lib.Buckets | None = None,
        worker_count: int = 0,
        prefetch: int = 2,
    ):
        distributed.check_joined()
        size = reading.source_size(source)
        if size == 0:
            raise ValueError("The source is empty (len(source)=0); a DataLoader needs at least one example.")
        mesh = runtime.data_mesh() if mesh is None else mesh
        if not isinstance(mesh, Mesh) or runtime.DATA_AXIS not in mesh.axis_names:
            raise TypeError(
                f"`mesh` must be a jax.sharding.Mesh with an axis named {runtime.DATA_AXIS!r} (jddp.data_mesh()), "
                f"got {mesh!r}."
            )
        devices = mesh.devices.size
        global_batch_size = sizes.global_batch(global_batch_size, per_device_batch_size, devices)
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
        accumulate_steps, padded = sizes.split_batch(global_batch_size, devices, max_per_device_batch_size)
        if drop_last and size < global_batch_size:
            raise ValueError(
                f"`source` is smaller than one global batch with `drop_last=True`: dataset_size={size}, "
                f"global_batch_size={global_batch_size}, so an epoch has no batch. Use a smaller batch or "
                "drop_last=False (the batch is then padded with masked entries), or check `source`: len(source) is "
                f"{size}."
            )
        if buckets is not None and not isinstance(buckets, buckets_lib.Buckets):
            raise TypeError(
                f"`buckets` must be a jddp.data.Buckets(boundaries=..., length=..., pad=...), or None, got "
                f"buckets={buckets!r:.80}."
            )
        options = {"global_batch_size": global_batch_size, "num_replicas": jax.process_count()}
        options |= {"rank": jax.process_index(), "seed": seed, "padded_batch_size": padded}
        if buckets is None:
            self.sampler = sampler_lib.DistributedBatchSampler(size, shuffle=shuffle, drop_last=drop_last, **options)
        else:
            lengths = buckets_lib.checked_lengths(buckets, reading.lengths(source, buckets))
            self.sampler = buckets_lib.BucketedBatchSampler(
                lengths, buckets, shuffle=shuffle, drop_last=drop_last, **options
            )
        self.buckets = buckets
        self.source, self.mesh = source, mesh
        self.global_batch_size: int = self.sampler.global_batch_size  # real examples per step, all devices together
        self.padded_batch_size: int = padded  # rows per step (the arrays' leading axis): examples, then padding
        self.per_device_batch_size: int = padded // devices  # rows per device and step, over its micro-batches
        self.max_per_device_batch_size = max_per_device_batch_size
        self.accumulate_steps: int = accumulate_steps  # for DataParallel(accumulate_steps=...)
        self.worker_count, self.prefetch = worker_count, prefetch
        self._read = reading.ReadBatch(source, self.sampler, transform, batch_transform)
        if transform is None and batch_transform is None:  # what the devices will get, said now, not at a step
            arrays = reading.arrays(source) or reading.read(source, np.zeros(1, np.int64))
            narrowed = {k: (v.dtype, fields.canonical(k, v[:1]).dtype) for k, v in arrays.items() if k != "mask"}
            fields.say_narrowed({k: f"{a} -> {b}" for k, (a, b) in narrowed.items() if a != b})
        self._sharding = runtime.batch_sharding(mesh)
        self._transfer = packing.Transfer(self._sharding, padded)
        self._stream = pipeline.Stream(self._read, worker_count=worker_count, prefetch=prefetch)
        self._agreed = False  # settings compared across processes at the first batch (a collective)
        standby.offer_batch(self._batch_ahead)  # a standby process compiles the step for it before it stands by

    def _batch_ahead(self) -> packing.PackedBatch | None:
        """A batch shaped as the next ones, read without moving the position and with no collective (a standby
        process's compilation, ``jddp.runtime.standby``); None at the end of the epoch."""
        batches = self.local_batches()
        try:
            local = next(batches, None)
        finally:
            batches.close()  # pyright: ignore[reportAttributeAccessIssue]  (a generator: its read-ahead stops)
        return None if local is None else self.to_global(local)

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

    def local_batches(self) -> Iterator[fields.Example]:
        """This process's NumPy slices from the position to the end of the epoch (position not advanced)."""
        options = {"worker_count": self.worker_count, "prefetch": self.prefetch}
        iterator = iter(pipeline.blocks(self._read, self.sampler.position, epochs=0, **options))
        try:
            for _, block, layout in iterator:
                for data in block:
                    yield packing.host_views(data, layout)
        finally:
            pipeline.close_iterator(iterator)

    def __iter__(self) -> Iterator[packing.PackedBatch]:
        if not self._agreed:
            self._agreed = True
            agreement.agree(self.sampler)
        end = (self.sampler.epoch + 1) * len(self.sampler)
        while self.sampler.position < end:
            with progress.phase("data"):
                data, layout = self._stream.next(self.sampler.position)
                batch = packing.PackedBatch(self._transfer(data), layout)
            self.sampler.position += 1  # consumed once handed out: a save now resumes after it
            yield batch

    def close(self) -> None:
        """Stops the read-ahead stream and its Grain workers; iterating again starts a new one."""
        self._stream.close()

    def to_global(self, local: fields.Example) -> packing.PackedBatch:
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
        local = fields.checked_local(local, self.sampler, self.padded_batch_size)
        data, layout = packing.pack(local)
        return packing.PackedBatch(self._transfer(data), layout)
