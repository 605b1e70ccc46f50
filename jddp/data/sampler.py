"""Which examples each process reads: a world-size-invariant distributed sampler.

Definitions:

* *global order* of epoch ``e``: a permutation of ``range(dataset_size)``
  drawn from ``numpy.random.default_rng([seed, e])`` (the identity when
  ``shuffle=False``);
* *global batch* ``b`` of an epoch: entries ``[b*B, (b+1)*B)`` of its order,
  ``B = global_batch_size``;
* *slots*: the global batch is laid out in ``P = padded_batch_size >= B``
  slots (``P = B`` unless set; ``jddp.data.DataLoader`` sets it so that every
  device and micro-batch takes the same number of rows); entry ``s < B`` of
  the global batch sits in slot ``s``, slots ``[B, P)`` are padding;
* *replica* ``r`` of ``R = num_replicas`` (PyTorch's rank and world size; in
  jddp a replica is a process) reads the contiguous slots
  ``[r*P/R, (r+1)*P/R)`` of every global batch: the rows that
  ``jax.make_array_from_process_local_data`` places on its devices;
* *position*: global batches consumed since the start; the epoch is
  ``position // len(sampler)``.

Guarantees:

* the sequence of global batches depends on ``(dataset_size, seed, shuffle,
  drop_last, global_batch_size)`` only, never on ``num_replicas``, nor on
  ``padded_batch_size``, which moves no real example from its slot;
* slices of one global batch are disjoint, and within an epoch every example
  appears exactly once (``drop_last=False``) or at most once
  (``drop_last=True``, the remainder dropped);
* with ``drop_last=False`` the last global batch is filled up with padding
  entries whose mask is 0 (they repeat valid indices so they can be read);
  so are the slots past ``B``;
* the epoch follows from the position, so an order never repeats because
  ``set_epoch`` was forgotten;
* ``state_dict()`` is a small JSON-able dict; ``load_state_dict`` accepts it
  on any ``num_replicas`` and continues the same global sequence (and on any
  ``padded_batch_size``: it is not part of the state).

Provenance: every global batch follows from the settings and its position,
so nothing needs logging to say which examples a past step trained on. A run
that consumes one batch per step (``jddp.fit``, or any loop over the loader)
took position ``step`` at each step, unless batches were skipped: ``skip(n)``
(after a loss spike: restore an earlier checkpoint, skip the batches that led
to it) records the skipped range of positions in the state, so a resumed run
and ``examples_at(step)`` keep mapping steps to positions correctly.

This module imports NumPy only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from jddp import validate

STATE_KEYS = ("position", "epoch", "seed", "dataset_size", "global_batch_size", "shuffle", "drop_last")


@dataclasses.dataclass(frozen=True)
class LocalBatch:
    """This replica's slice of one global batch.

    Attributes:
      position: the global batch's position (since the start of training).
      epoch: its epoch.
      indices: ``int64[P/R]`` dataset indices to read.
      mask: ``float32[P/R]``, 1 for real examples, 0 for padding.
      order: ``int64[P/R]`` each entry's place in the epoch's global order
        (seeds per-example randomness independently of ``num_replicas``).
    """

    position: int
    epoch: int
    indices: np.ndarray
    mask: np.ndarray
    order: np.ndarray


class DistributedBatchSampler:
    """PyTorch's ``DistributedBatchSampler``, made world-size invariant and resumable.

    Args:
      dataset_size: number of examples, at least 1.
      global_batch_size: examples per global batch, over all replicas.
      num_replicas: number of readers (processes); divides ``padded_batch_size``.
      rank: this reader's index, ``0 <= rank < num_replicas``.
      shuffle: draw a new global order every epoch.
      seed: seeds the orders; the same seed gives the same sequence.
      drop_last: drop the incomplete last batch (``True``) or pad it with
        masked entries (``False``).
      padded_batch_size: slots per global batch, at least ``global_batch_size``
        (None: equal to it); the slots past ``global_batch_size`` are padding
        (mask 0). It changes the rows read, never which examples form a batch.

    Raises:
      ValueError: for an empty dataset, a batch that the replicas cannot split,
        a rank out of range, a padded size below the batch size, or a dataset
        smaller than one batch with ``drop_last=True``.

    Example:
      >>> s = DistributedBatchSampler(10, global_batch_size=4, num_replicas=2, rank=1, shuffle=False, drop_last=False)
      >>> len(s), [b.indices.tolist() for b in s], [b.mask.tolist() for b in s][-1]
      (3, [[2, 3], [6, 7], [0, 1]], [0.0, 0.0])
      >>> p = DistributedBatchSampler(10, global_batch_size=3, num_replicas=2, shuffle=False, padded_batch_size=4)
      >>> [(b.indices.tolist(), b.mask.tolist()) for b in p][:2]
      [([0, 1], [1.0, 1.0]), ([3, 4], [1.0, 1.0])]
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        global_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        padded_batch_size: int | None = None,
    ):
        _check_int("dataset_size", dataset_size, 1, "the dataset is empty; give it at least one example")
        _check_int("global_batch_size", global_batch_size, 1, "use a positive batch size")
        if padded_batch_size is None:
            padded_batch_size = global_batch_size
        _check_int(
            "padded_batch_size",
            padded_batch_size,
            global_batch_size,
            f"it is the global batch's {global_batch_size} entries plus padding slots, or None for no padding",
        )
        _check_int("num_replicas", num_replicas, 1, "use at least one replica")
        _check_int("seed", seed, 0, "use a non-negative seed")
        _check_int("rank", rank, 0, "ranks count from 0")
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(value, bool | np.bool_):
                raise TypeError(f"`{name}` must be True or False, got {name}={value!r}.")
        if padded_batch_size % num_replicas:
            name = "global_batch_size" if padded_batch_size == global_batch_size else "padded_batch_size"
            raise ValueError(
                f"`{name}` must be divisible by `num_replicas` (processes), got "
                f"{name}={padded_batch_size}, num_replicas={num_replicas}; use a multiple of {num_replicas}."
            )
        if not 0 <= rank < num_replicas:
            raise ValueError(f"`rank` must be in [0, num_replicas), got rank={rank}, num_replicas={num_replicas}.")
        if drop_last and dataset_size < global_batch_size:
            raise ValueError(
                f"The dataset is smaller than one global batch with `drop_last=True`: dataset_size="
                f"{dataset_size}, global_batch_size={global_batch_size}, so an epoch has no batch. Use a "
                "smaller batch or drop_last=False (the batch is then padded with masked entries)."
            )
        self.dataset_size, self.global_batch_size = dataset_size, global_batch_size
        self.padded_batch_size = padded_batch_size  # slots per global batch: entries, then padding
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.drop_last = bool(shuffle), seed, bool(drop_last)
        self.local_batch_size = padded_batch_size // num_replicas
        self.position = 0
        self.skipped: list[tuple[int, int]] = []  # ranges [start, stop) of positions skipped, in order
        self._order_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        """Global batches per epoch."""
        full, rest = divmod(self.dataset_size, self.global_batch_size)
        return full + (0 if self.drop_last or not rest else 1)

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.position // len(self)

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch`` unless the position is already inside it.

        Kept for PyTorch habits: the epoch follows from the position anyway.
        """
        _check_int("epoch", epoch, 0, "epochs count from 0")
        if self.epoch != epoch:
            self.position = epoch * len(self)

    def skip(self, batches: int) -> None:
        """Skips the next ``batches`` global batches (their examples are not read), and records it.

        Example:
          >>> s = DistributedBatchSampler(100, global_batch_size=10)
          >>> s.position = 7; s.skip(3); s.position, s.skipped, s.position_of_step(7)
          (10, [(7, 10)], 10)
        """
        check_skip(batches)
        self.skipped.append((self.position, self.position + batches))
        self.position += batches

    def position_of_step(self, step: int) -> int:
        """The position of the global batch that training step ``step`` (from 0) took: ``step`` plus the batches
        skipped before it."""
        _check_int("step", step, 0, "steps count from 0")
        position = step
        for start, stop in sorted(self.skipped):
            if position < start:
                break
            position += stop - start
        return position

    def examples_at(self, step: int) -> np.ndarray:
        """The dataset indices of the real examples (not padding) that formed step ``step``'s global batch, in
        the global order; the same on any number of replicas.

        Example:
          >>> s = DistributedBatchSampler(10, global_batch_size=4, shuffle=False, drop_last=False)
          >>> s.examples_at(0), s.examples_at(2), s.examples_at(3)
          (array([0, 1, 2, 3]), array([8, 9]), array([0, 1, 2, 3]))
        """
        indices, mask, _ = self.global_batch(self.position_of_step(step))
        return indices[mask > 0]

    def order(self, epoch: int) -> np.ndarray:
        """The global order of ``epoch``: a permutation of the dataset's indices."""
        _check_int("epoch", epoch, 0, "epochs count from 0")
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.dataset_size)
            else:
                order = np.arange(self.dataset_size)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def global_batch(self, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(indices, mask, order)`` of the global batch at ``position``, all replicas: its
        ``padded_batch_size`` slots."""
        _check_int("position", position, 0, "positions count from 0")
        return tuple(a[0] for a in self._block(position, 1, 0, self.padded_batch_size))

    def local_batch(self, position: int) -> LocalBatch:
        """This replica's slice of the global batch at ``position``."""
        _check_int("position", position, 0, "positions count from 0")
        indices, mask, places = self.local_block(position, 1)
        return LocalBatch(position, position // len(self), indices[0], mask[0], places[0])

    def local_block(self, position: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This replica's slices of ``count`` consecutive global batches of one epoch, in one go.

        Returns:
          ``(indices, mask, order)``, each ``[count, P/R]``: row ``j`` is
          ``local_batch(position + j)``'s ``indices``, ``mask`` and ``order``.

        Raises:
          ValueError: if the batches run past the end of ``position``'s epoch.
        """
        _check_int("position", position, 0, "positions count from 0")
        _check_int("count", count, 1, "read at least one batch")
        if position % len(self) + count > len(self):
            raise ValueError(
                f"A block must lie inside one epoch of {len(self)} batches, got position={position}, "
                f"count={count}; split it at the epoch boundary."
            )
        return self._block(position, count, self.rank * self.local_batch_size, self.local_batch_size)

    def _block(self, position: int, count: int, lo: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        epoch, b = divmod(position, len(self))
        slots = lo + np.arange(width, dtype=np.int64)  # slots [B, P) are padding
        places = ((b + np.arange(count, dtype=np.int64)) * self.global_batch_size)[:, None] + slots
        valid = (places < self.dataset_size) & (slots < self.global_batch_size)
        mask = valid.astype(np.float32)
        if not valid.all():
            places = np.where(valid, places, places % self.dataset_size)  # padding re-reads valid entries
        return self.order(epoch)[places], mask, places

    def __iter__(self) -> Iterator[LocalBatch]:
        """This replica's batches from the position to the end of its epoch, advancing it."""
        end = (self.epoch + 1) * len(self)
        while self.position < end:
            batch = self.local_batch(self.position)
            self.position += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The global cursor and what it is valid for; JSON-able, replica-independent."""
        return {
            "position": self.position,
            "epoch": self.epoch,
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "skipped": [list(r) for r in self.skipped],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues the global sequence saved in ``state`` (any ``num_replicas``).

        Raises:
          TypeError: if ``state`` is not a mapping.
          ValueError: if ``state`` lacks keys, or belongs to another dataset,
            seed, batch size, shuffle or drop_last setting, or to other length
            buckets (``jddp.data.buckets``).
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"`state` must be the dict that `state_dict()` (or DataLoader.get_state()) returned, got "
                f"{type(state).__name__}."
            )
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"Sampler state lacks keys {missing}; it must come from `state_dict()`.")
        self._check_buckets(state)
        mine = self.state_dict()
        diff = [f"{k}: saved {state[k]!r}, here {mine[k]!r}" for k in STATE_KEYS[2:] if state[k] != mine[k]]
        if diff:
            raise ValueError(
                "The sampler state belongs to another data setup (" + "; ".join(diff) + "). Restore it "
                "with the dataset and settings it was saved with, or start this data from scratch."
            )
        _check_int("position", state["position"], 0, "positions count from 0")
        skipped = _skipped_ranges(state.get("skipped", []), int(state["position"]))
        self.position = int(state["position"])
        self.skipped = skipped

    def _check_buckets(self, state: Mapping[str, Any]) -> None:
        """Refuses a state saved by a loader that bucketed by length (``jddp.data.buckets``): other batches."""
        if state.get("buckets") is not None:
            raise ValueError(
                f"The sampler state was saved by a loader with buckets ({state['buckets']!r:.120}); this one has "
                "none, which makes other global batches. Restore it with the same `buckets=jddp.data.Buckets(...)`, "
                "or start this data from scratch."
            )


def _skipped_ranges(value: Any, position: int) -> list[tuple[int, int]]:
    """The ``skipped`` entry of a state, checked: increasing, disjoint ranges before ``position``."""
    ranges, end = [], 0
    for r in value if isinstance(value, list) else [None]:
        ok = isinstance(r, list | tuple) and len(r) == 2 and all(type(x) is int for x in r)
        if not (ok and r is not None and end <= r[0] < r[1] <= position):
            raise ValueError(
                f"Sampler state has skipped={value!r}: it must be a list of increasing, disjoint [start, stop) "
                f"position ranges before the position {position}, as `state_dict()` writes it."
            )
        ranges.append((int(r[0]), int(r[1])))
        end = r[1]
    return ranges


def check_skip(batches: Any) -> None:
    """Raises unless ``batches`` is a number of batches to skip (an int of at least 1)."""
    _check_int("batches", batches, 1, "skip at least one batch")


def _check_int(name: str, value: Any, minimum: int, fix: str) -> None:
    validate.check_int(name, value, minimum=minimum, fix=fix[:1].upper() + fix[1:] + ".")
