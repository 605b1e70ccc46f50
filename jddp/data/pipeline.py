"""The Grain pipeline of a loader: packed blocks read in worker processes or ahead by a thread, as one stream.

Each element is ``jddp.data.reading.ReadBatch``'s block of up to ``batches_per_read`` batches. ``Stream`` keeps one
pipeline running on across epochs, so that Grain's workers and read-ahead live as long as the loader.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import grain
import numpy as np

from jddp.data import reading
from jddp.runtime import packing

# Grain workers hand back arrays below this size pickled through their queue,
# larger ones in a fresh shared-memory segment each (Grain's default is 0: all
# through shared memory). A block of at most ~READ_BYTES costs less pickled.
_MIN_SHM_BYTES = 2 * reading.READ_BYTES
# The read-ahead stream covers this many epochs past the current one (then restarts).
_EPOCHS_AHEAD = 1 << 20


def blocks(read: reading.ReadBatch, start: int, epochs: int, *, worker_count: int, prefetch: int) -> grain.IterDataset:
    """Grain pipeline of packed blocks from position ``start`` to the end of ``epochs`` more epochs.

    Each element is ``read``'s block of up to ``batches_per_read``
    batches, read (and transformed) in Grain workers when ``worker_count``
    > 0 and read ahead by a thread when ``prefetch`` > 0.
    """
    first = _FirstPosition(start, len(read.sampler), read.batches_per_read)
    count = first.blocks_in_first_epoch + epochs * first.blocks_per_epoch
    dataset = grain.MapDataset.range(count).map(first).map(read)
    it = dataset.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    ahead = -(-prefetch // read.batches_per_read)  # in blocks, rounded up
    if worker_count:
        _absl_flags_parsed()
        shm = grain.experimental.DatasetOptions(min_shm_size=_MIN_SHM_BYTES)
        it = grain.experimental.WithOptionsIterDataset(it, shm)
        options = grain.MultiprocessingOptions(worker_count, per_worker_buffer_size=max(ahead, 1))
        it = it.mp_prefetch(options)
    elif ahead:
        it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=ahead)
    return it


class Stream:
    """The local rows of consecutive positions, from one pipeline that runs on across epochs.

    Grain workers and read-ahead therefore live as long as the loader
    instead of restarting every epoch (a worker start is seconds of
    imports). The pipeline restarts only when the position moved
    (``set_state``, ``set_epoch``) or a read failed.
    """

    def __init__(self, read: reading.ReadBatch, *, worker_count: int, prefetch: int):
        self.read, self.worker_count, self.prefetch = read, worker_count, prefetch
        # The pipeline sits in a box that a finalizer closes when the stream (with its loader) goes
        # away or at exit, before the interpreter tears down what Grain's own cleanup needs.
        self.box: list[Iterator | None] = [None]
        weakref.finalize(self, _close_box, self.box)
        self._position, self._rows, self._layout = -1, iter(()), ()

    def next(self, position: int) -> tuple[np.ndarray, tuple[packing.Field, ...]]:
        """The local rows at ``position``, and their layout."""
        if self.box[0] is None or self._position != position:
            self.close()
            options = {"worker_count": self.worker_count, "prefetch": self.prefetch}
            self.box[0] = iter(blocks(self.read, position, epochs=_EPOCHS_AHEAD, **options))
            self._position, self._rows = position, iter(())
        row = next(self._rows, None)
        if row is None:
            try:
                first, block, self._layout = next(self.box[0])
            except BaseException:
                self.close()
                raise
            assert first == self._position, (first, self._position)
            self._rows = iter(block)
            row = next(self._rows)
        self._position += 1
        return row, self._layout

    def close(self) -> None:
        """Stops the pipeline and its Grain workers; the next ``next`` starts a new one."""
        _close_box(self.box)


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
        close_iterator(iterator)


def close_iterator(iterator) -> None:
    """Closes ``iterator`` if it can be closed (a Grain iterator stops its workers and read-ahead thread)."""
    close = getattr(iterator, "close", None)
    if close is not None:
        close()


def _absl_flags_parsed() -> None:
    """Grain's worker processes read absl flags; outside ``absl.app.run`` nobody parsed them."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
