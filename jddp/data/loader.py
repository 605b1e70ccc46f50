"""A Grain-based loader that reads only this process's slice of each global batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh

from jddp import packing, runtime
from jddp.data import sampler as sampler_lib

Example = dict[str, np.ndarray]
Transform = Callable[[Example, np.random.Generator], Example]


class _ReadBatch:
    """Reads one local batch by position; pickled into Grain worker processes."""

    def __init__(self, source, sampler, transform: Transform | None, batch_transform: Transform | None):
        self.source, self.sampler = source, sampler
        self.transform, self.batch_transform = transform, batch_transform

    def __call__(self, position: int) -> Example:
        local = self.sampler.local_batch(int(position))
        batch = read(self.source, local.indices)
        seed = self.sampler.seed
        if self.transform is not None:
            rows = [{k: v[i] for k, v in batch.items()} for i in range(len(local.indices))]
            rngs = [np.random.default_rng([seed, local.epoch, int(p)]) for p in local.order]
            batch = _stack([self.transform(row, rng) for row, rng in zip(rows, rngs, strict=True)])
        if self.batch_transform is not None:
            batch = self.batch_transform(batch, np.random.default_rng([seed, local.position, self.sampler.rank]))
        batch["mask"] = local.mask
        return batch


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
    return _stack([r if isinstance(r, Mapping) else {"x": r} for r in records])


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
    try:
        return len(source)
    except TypeError:
        raise TypeError(
            f"The source must support `len()` and indexing (a NumPy array, a dict of arrays or a Grain "
            f"data source), got {type(source).__name__}."
        ) from None


class DataLoader:
    """Global batches for ``DataParallel.step``, each process reading only its slice.

    The order of examples comes from a ``DistributedSampler`` (world-size
    invariant, see ``jddp.data.sampler``); Grain runs the reads and transforms,
    in worker processes if asked, and prefetches; each yielded batch is a
    mapping of the source's keys plus ``"mask"`` (0 for padding) to global
    arrays with leading axis of size ``global_batch_size``, sharded over
    ``"data"``: a ``jddp.packing.PackedBatch``, one byte array on the devices
    that ``DataParallel`` unpacks inside its step.

    Iterating gives the batches from the current position to the end of its
    epoch, as iterating a PyTorch ``DataLoader`` does; iterate again for the
    next epoch. ``get_state()``/``set_state()`` save and restore the position,
    also onto a different number of processes or devices.

    Args:
      source: a dict of equally long arrays, one array (yielded as ``"x"``), or
        any random-access source with ``len`` and ``[i]`` (a Grain data source).
      global_batch_size: examples per step over all processes; divisible by the
        number of devices of ``mesh``.
      mesh: where batches go; ``jddp.data_mesh()`` when None.
      shuffle, seed, drop_last: as for ``DistributedSampler``.
      transform: ``transform(example, rng) -> example`` per example; ``rng`` is
        a NumPy Generator seeded by (seed, epoch, place in the global order), so
        results do not depend on the number of processes.
      batch_transform: ``batch_transform(batch, rng) -> batch`` on this
        process's slice; ``rng`` is seeded by (seed, position, process).
      worker_count: Grain worker processes (0 reads in this process; workers
        need the ``if __name__ == "__main__":`` guard).
      prefetch: batches read ahead (per worker with workers).

    Raises:
      ValueError: for an empty source or a batch the devices cannot split.

    Example:
      >>> import numpy as np, jddp
      >>> loader = jddp.data.DataLoader({"x": np.arange(20.0)}, global_batch_size=8, shuffle=False, drop_last=False)
      >>> [b["mask"].sum().item() for b in loader], loader.get_state()["epoch"]
      ([8.0, 8.0, 4.0], 1)
    """

    def __init__(
        self,
        source,
        *,
        global_batch_size: int,
        mesh: Mesh | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        transform: Transform | None = None,
        batch_transform: Transform | None = None,
        worker_count: int = 0,
        prefetch: int = 2,
    ):
        size = source_size(source)
        if size == 0:
            raise ValueError("The source is empty (len(source)=0); a DataLoader needs at least one example.")
        mesh = runtime.data_mesh() if mesh is None else mesh
        devices = mesh.devices.size
        if isinstance(global_batch_size, int) and global_batch_size % devices:
            raise ValueError(
                f"`global_batch_size` must be divisible by the number of devices (processes x local "
                f"devices), got global_batch_size={global_batch_size}, processes={jax.process_count()}, "
                f"devices={devices}. Use a multiple of {devices}."
            )
        for name, value in (("worker_count", worker_count), ("prefetch", prefetch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"`{name}` must be an int >= 0, got {name}={value!r}.")
        self.sampler = sampler_lib.DistributedSampler(
            size,
            global_batch_size=global_batch_size,
            num_replicas=jax.process_count(),
            rank=jax.process_index(),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.source, self.mesh = source, mesh
        self.worker_count, self.prefetch = worker_count, prefetch
        self._read = _ReadBatch(source, self.sampler, transform, batch_transform)
        self._sharding = runtime.batch_sharding(mesh)

    def __len__(self) -> int:
        """Global batches per epoch."""
        return len(self.sampler)

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """As ``DistributedSampler.set_epoch``; optional, the position implies the epoch."""
        self.sampler.set_epoch(epoch)

    def get_state(self) -> dict[str, Any]:
        """The position in the global sequence, JSON-able and independent of the process count."""
        return self.sampler.state_dict()

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from ``state``; raises ``ValueError`` for another data setup."""
        self.sampler.load_state_dict(state)

    def _pipeline(self, on_device: bool) -> grain.IterDataset:
        """Grain pipeline over positions from the cursor to the end of its epoch.

        Reads (and transforms) run in Grain workers when ``worker_count`` > 0;
        with ``on_device`` the global arrays are assembled in the prefetch
        thread, so the training loop only takes ready batches off a queue.
        """
        start = self.sampler.position
        end = (self.sampler.epoch + 1) * len(self.sampler)
        dataset = grain.MapDataset.range(start, end).map(self._read)
        it = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        if self.worker_count:
            _absl_flags_parsed()
            options = grain.MultiprocessingOptions(self.worker_count, per_worker_buffer_size=max(self.prefetch, 1))
            it = it.mp_prefetch(options)
        if on_device:
            it = it.map(self.to_global)
        if self.prefetch:
            it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=self.prefetch)
        return it

    def _iterate(self, on_device: bool) -> Iterator:
        iterator = iter(self._pipeline(on_device))
        try:
            yield from iterator
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    def local_batches(self) -> Iterator[Example]:
        """This process's NumPy slices from the position to the end of the epoch (position not advanced)."""
        return self._iterate(on_device=False)

    def __iter__(self) -> Iterator[packing.PackedBatch]:
        for batch in self._iterate(on_device=True):
            self.sampler.position += 1  # consumed once handed out: a save now resumes after it
            yield batch

    def to_global(self, local: Example) -> packing.PackedBatch:
        """This process's rows as one global batch sharded over ``"data"``.

        The arrays travel packed into one byte array (one buffer per device
        instead of one per array and device; see ``jddp.packing``).
        """
        data, layout = packing.pack(local)
        if jax.process_count() == 1:
            return packing.PackedBatch(jax.device_put(data, self._sharding), layout)
        shape = (self.sampler.global_batch_size, data.shape[1])
        return packing.PackedBatch(jax.make_array_from_process_local_data(self._sharding, data, shape), layout)
