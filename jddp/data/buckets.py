"""Variable-length examples in a few fixed shapes: which bucket each global batch is, world-size invariant.

Definitions (``Buckets`` holds the settings, ``BucketedBatchSampler`` the order):

* *length* of an example: the size of its sequence axis, known before any
  batch is read: a field of the source (``length="length"``) or
  ``length_fn(example) -> int`` (``length=callable``), computed once for
  every example when the loader is built;
* *bucket* ``k`` of ``boundaries = (b_0 < b_1 < ... < b_{K-1})``: the
  examples of length ``L`` with ``b_{k-1} < L <= b_k`` (``b_{-1} = -1``);
  their batches are padded to ``b_k`` along the sequence axis, so a run
  compiles at most ``K`` step programs;
* a length above ``b_{K-1}`` is refused, naming the example, unless
  ``too_long="truncate"``, which cuts it to ``b_{K-1}``;
* *global batches* of epoch ``e`` (``tf.data``'s ``bucket_by_sequence_length``,
  made deterministic): walk the epoch's global order (the permutation of
  ``DistributedBatchSampler``, drawn from ``(seed, e)``), put each example
  into its bucket, and emit a bucket's ``B`` examples as one global batch as
  soon as it holds them; at the end of the order the incomplete rest of each
  bucket is dropped (``drop_last=True``) or emitted, in bucket order, as one
  batch whose missing entries are padding (mask 0, re-reading an example of
  the same batch);
* slots, replicas and the position are ``DistributedBatchSampler``'s: replica
  ``r`` reads the contiguous slots ``[r*P/R, (r+1)*P/R)`` of every global
  batch, and the position counts global batches since the start.

Guarantees:

* every global batch is one bucket: one shape on every process at each step;
* the sequence of global batches depends on the lengths, ``boundaries``,
  ``too_long``, ``seed``, ``shuffle``, ``drop_last`` and
  ``global_batch_size`` only, never on ``num_replicas`` or
  ``padded_batch_size``;
* within an epoch every example appears exactly once (``drop_last=False``) or
  at most once (``drop_last=True``: each bucket's remainder is dropped);
* the number of batches per epoch is the same every epoch (each bucket's
  count of examples does not depend on the order);
* ``state_dict()`` adds the boundaries, ``too_long`` and a digest of the
  lengths to the sampler's state; ``load_state_dict`` resumes it on any
  ``num_replicas`` and refuses it for other lengths or boundaries, and a
  plain sampler refuses a bucketed state (and the other way round).

This module imports NumPy only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jddp.data import sampler as sampler_lib

TOO_LONG = ("refuse", "truncate")


@dataclasses.dataclass(frozen=True)
class Buckets:
    """How ``DataLoader(..., buckets=...)`` batches variable-length examples: one bucket per global batch.

    Args:
      boundaries: increasing positive ints: the sequence lengths the batches are padded to; an example goes into
        the first bucket whose boundary is at least its length (Flax's sst2 ``bucket_boundaries``).
      length: the name of a source field holding each example's length (an int per example), or
        ``length_fn(example) -> int`` called once per example when the loader is built.
      pad: ``{field: padding value}`` for each field with a sequence axis (its first axis per example): it is cut
        or padded to the batch's boundary, and its entries from the example's length on hold the padding value.
        Other fields keep their shape.
      too_long: ``"refuse"`` (a ``ValueError`` naming the first such example) or ``"truncate"`` (cut to the last
        boundary; a ``length`` field then says the cut length) for an example longer than the last boundary.

    Raises:
      ValueError: boundaries not increasing positive ints, an empty ``pad``, a ``length`` field that is also
        padded, or an unknown ``too_long``.
      TypeError: ``length`` neither a field name nor a function, or a padding value that is not a number.

    Example:
      >>> b = Buckets(boundaries=(8, 16, 32), length="length", pad={"tokens": 0})
      >>> bucket_of(b, np.array([3, 8, 9, 32])).tolist()
      [0, 0, 1, 2]
    """

    boundaries: tuple[int, ...]
    length: str | Callable[[Mapping[str, np.ndarray]], int]
    pad: Mapping[str, int | float]
    too_long: str = "refuse"

    def __post_init__(self):
        given = self.boundaries
        if isinstance(given, int | np.integer) or not isinstance(given, list | tuple | np.ndarray):
            raise ValueError(
                f"`boundaries` must be a tuple of increasing positive ints (the padded lengths), got "
                f"boundaries={given!r}; for example boundaries=(16, 32, 64)."
            )
        bad = [b for b in given if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1]
        if not len(given) or bad or any(a >= b for a, b in itertools.pairwise(given)):
            raise ValueError(
                f"`boundaries` must be a non-empty tuple of strictly increasing ints >= 1 (the padded lengths), got "
                f"boundaries={tuple(given)!r}; for example boundaries=(16, 32, 64)."
            )
        object.__setattr__(self, "boundaries", tuple(int(b) for b in given))
        if not (isinstance(self.length, str) and self.length) and not callable(self.length):
            raise TypeError(
                f"`length` must be the name of a source field of lengths, or a function length_fn(example) -> int, "
                f"got length={self.length!r:.80}."
            )
        if not isinstance(self.pad, Mapping) or not self.pad:
            raise ValueError(
                f"`pad` must map each field with a sequence axis to its padding value, e.g. pad={{'tokens': 0}}, "
                f"got pad={self.pad!r:.80}."
            )
        for name, value in self.pad.items():
            if not isinstance(name, str) or name == "mask":
                raise ValueError(
                    f"`pad` names the fields to pad, got {name!r}: use the source's field names (not 'mask', the "
                    "per-example mask the loader adds)."
                )
            if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
                raise TypeError(f"`pad` values must be numbers, got pad[{name!r}]={value!r}; for example 0.")
        if isinstance(self.length, str) and self.length in self.pad:
            raise ValueError(
                f"`length`={self.length!r} is a field of one int per example; it cannot also be padded (in `pad`)."
            )
        object.__setattr__(self, "pad", dict(self.pad))
        if self.too_long not in TOO_LONG:
            raise ValueError(f"`too_long` must be one of {TOO_LONG}, got too_long={self.too_long!r}.")


def bucket_of(buckets: Buckets, lengths: np.ndarray) -> np.ndarray:
    """The bucket of each length (lengths above the last boundary go to the last bucket)."""
    k = np.searchsorted(np.asarray(buckets.boundaries), lengths, side="left")
    return np.minimum(k, len(buckets.boundaries) - 1)


def checked_lengths(buckets: Buckets, lengths: Any) -> np.ndarray:
    """``lengths`` as ``int64[N]``, those above the last boundary cut to it (``too_long="truncate"``).

    Raises:
      ValueError: a length that is negative, not an int, or above the last boundary with ``"refuse"``, naming
        the first such example.
    """
    raw = np.asarray(lengths)
    if raw.ndim != 1 or not (np.issubdtype(raw.dtype, np.integer) or raw.size == 0):
        raise ValueError(
            f"The examples' lengths must be one int per example, got an array of shape {raw.shape} and dtype "
            f"{raw.dtype}; `length` must name a field of ints or return an int."
        )
    raw = raw.astype(np.int64)
    negative = np.flatnonzero(raw < 0)
    if negative.size:
        i = int(negative[0])
        raise ValueError(f"Example {i} has length {int(raw[i])}: lengths must be >= 0.")
    last = buckets.boundaries[-1]
    over = np.flatnonzero(raw > last)
    if over.size and buckets.too_long == "refuse":
        i = int(over[0])
        raise ValueError(
            f"Example {i} has length {int(raw[i])}, above the last bucket boundary {last} (and {over.size - 1} "
            f"more examples do, the longest {int(raw.max())}). Add a boundary of at least {int(raw.max())} to "
            "`boundaries`, drop those examples from the source, or pass too_long='truncate' to cut them to "
            f"{last}."
        )
    return np.minimum(raw, last)


def settings(buckets: Buckets, lengths: np.ndarray) -> dict[str, Any]:
    """What a saved position and the processes' agreement depend on: boundaries, ``too_long``, the lengths."""
    digest = hashlib.sha256(np.ascontiguousarray(lengths, np.int64).tobytes()).hexdigest()[:16]
    return {"boundaries": list(buckets.boundaries), "too_long": buckets.too_long, "lengths": digest}


class BucketedBatchSampler(sampler_lib.DistributedBatchSampler):
    """``DistributedBatchSampler`` whose global batches each hold examples of one length bucket.

    Args:
      lengths: one length per example (``Buckets.checked_lengths``'s result: cut to the last boundary).
      buckets: the ``Buckets`` settings (boundaries, ``too_long``).
      global_batch_size, num_replicas, rank, shuffle, seed, drop_last, padded_batch_size: as for
        ``DistributedBatchSampler``.

    Raises:
      ValueError: as ``DistributedBatchSampler``, a length outside the buckets, or ``drop_last=True`` with no
        bucket holding a whole batch.

    Example:
      >>> b = Buckets(boundaries=(2, 4), length="n", pad={"t": 0})
      >>> s = BucketedBatchSampler(np.array([1, 3, 2, 4, 1, 3]), b, global_batch_size=2, shuffle=False,
      ...                          drop_last=False)
      >>> [(s.global_batch(p)[0].tolist(), s.global_batch(p)[1].tolist(), s.boundary_at(p)) for p in range(len(s))]
      [([0, 2], [1.0, 1.0], 2), ([1, 3], [1.0, 1.0], 4), ([4, 4], [1.0, 0.0], 2), ([5, 5], [1.0, 0.0], 4)]
    """

    def __init__(
        self,
        lengths: np.ndarray,
        buckets: Buckets,
        *,
        global_batch_size: int,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        padded_batch_size: int | None = None,
    ):
        if not isinstance(buckets, Buckets):
            raise TypeError(f"`buckets` must be a jddp.data.Buckets, got buckets={buckets!r:.80}.")
        lengths = checked_lengths(buckets, lengths)
        if not len(lengths):
            raise ValueError("The dataset is empty (no lengths); give it at least one example.")
        self.buckets, self.lengths = buckets, lengths
        self.bucket = bucket_of(buckets, lengths)  # each example's bucket
        self.bucket_sizes = np.bincount(self.bucket, minlength=len(buckets.boundaries))
        self._plan_cache: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None
        super().__init__(
            len(lengths),
            global_batch_size=global_batch_size,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            padded_batch_size=padded_batch_size,
        )
        if len(self) == 0:
            counts = {b: int(n) for b, n in zip(buckets.boundaries, self.bucket_sizes, strict=True)}
            raise ValueError(
                f"No bucket holds a whole global batch of {global_batch_size} with `drop_last=True` (examples per "
                f"bucket boundary: {counts}), so an epoch has no batch. Use a smaller batch, fewer boundaries, or "
                "drop_last=False (each bucket's rest is then padded with masked entries)."
            )

    def __len__(self) -> int:
        """Global batches per epoch: each bucket's whole batches, plus its rest unless ``drop_last``."""
        full, rest = np.divmod(self.bucket_sizes, self.global_batch_size)
        return int(full.sum() + (0 if self.drop_last else np.count_nonzero(rest)))

    def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Epoch ``epoch``'s global batches: ``(places, counts, buckets)``.

        ``places[j]`` is ``int64[B]``: the places in the epoch's global order (``order(epoch)``) of batch ``j``'s
        entries, -1 past its ``counts[j]`` real entries; ``buckets[j]`` is its bucket.
        """
        sampler_lib._check_int("epoch", epoch, 0, "epochs count from 0")
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            self._plan_cache = (epoch, *self._plan(self.order(epoch)))
        return self._plan_cache[1:]

    def _plan(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        size, n = self.global_batch_size, self.dataset_size
        in_order = self.bucket[order]  # the bucket of each place of the order
        rows, done, counts, kinds = [], [], [], []
        for k in range(len(self.buckets.boundaries)):
            places = np.flatnonzero(in_order == k)  # this bucket's places, in the order's sequence
            full, rest = divmod(len(places), size)
            whole = places[: full * size].reshape(full, size)
            rows.append(whole)
            done.append(whole[:, -1])  # a batch is emitted when its last entry arrives
            counts.append(np.full(full, size))
            kinds.append(np.full(full, k))
            if rest and not self.drop_last:
                tail = np.full((1, size), -1, np.int64)
                tail[0, :rest] = places[full * size :]
                rows.append(tail)
                done.append(np.array([n + k]))  # after every whole batch, in bucket order
                counts.append(np.array([rest]))
                kinds.append(np.array([k]))
        first = np.argsort(np.concatenate(done), kind="stable")
        places, counts, kinds = (np.concatenate(a).astype(np.int64)[first] for a in (rows, counts, kinds))
        return places, counts, kinds

    def boundary_at(self, position: int) -> int:
        """The sequence length of the global batch at ``position``: its bucket's boundary."""
        sampler_lib._check_int("position", position, 0, "positions count from 0")
        epoch, b = divmod(position, len(self))
        return self.buckets.boundaries[int(self.plan(epoch)[2][b])]

    def _block(self, position: int, count: int, lo: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        epoch, b = divmod(position, len(self))
        places, counts, kinds = (a[b : b + count] for a in self.plan(epoch))
        if len(set(kinds.tolist())) > 1:
            raise ValueError(
                f"A block of bucketed batches must lie inside one bucket, got position={position}, count={count} "
                f"over buckets {sorted(set(kinds.tolist()))}; read one batch at a time."
            )
        slots = lo + np.arange(width, dtype=np.int64)
        valid = (slots[None] < counts[:, None]) & (slots[None] < self.global_batch_size)
        # padding re-reads a real entry of the same batch, so it fits the batch's shape
        read = np.take_along_axis(places, np.broadcast_to(slots % counts[:, None], valid.shape), axis=1)
        return self.order(epoch)[read], valid.astype(np.float32), read

    def state_dict(self) -> dict[str, Any]:
        """``DistributedBatchSampler.state_dict`` plus ``"buckets"``: boundaries, ``too_long``, a digest of the
        lengths."""
        return {**super().state_dict(), "buckets": settings(self.buckets, self.lengths)}

    def _check_buckets(self, state: Mapping[str, Any]) -> None:
        mine = settings(self.buckets, self.lengths)
        saved = state.get("buckets")
        if saved is None:
            raise ValueError(
                "The sampler state was saved by a loader without buckets; this one buckets by length "
                f"({mine['boundaries']}), which makes other global batches. Restore it without `buckets`, or start "
                "this data from scratch."
            )
        if not isinstance(saved, Mapping) or saved != mine:
            if isinstance(saved, Mapping):
                shown = "; ".join(
                    f"{k}: saved {saved.get(k)!r}, here {v!r}" for k, v in mine.items() if saved.get(k) != v
                )
            else:
                shown = f"saved {saved!r:.120}"
            raise ValueError(
                f"The sampler state belongs to other buckets ({shown}): the lengths digest says which examples' "
                "lengths formed the batches. Restore it with the source and `Buckets` it was saved with, or start "
                "this data from scratch."
            )


def pad_value(name: str, value: int | float, dtype: np.dtype) -> np.ndarray:
    """``pad[name]`` as a value of the field's ``dtype``, or a ``ValueError`` if that changes it."""
    cast = np.asarray(value).astype(dtype)
    if not np.array_equal(cast, np.asarray(value), equal_nan=True):
        raise ValueError(
            f"`pad[{name!r}]={value!r}` does not fit field {name!r}'s dtype {np.dtype(dtype)} (it becomes "
            f"{cast.item()!r}); use a padding value of that dtype."
        )
    return cast


def fill(out: np.ndarray, rows: np.ndarray, lengths: np.ndarray, value: np.ndarray) -> None:
    """Writes ``rows`` (``[n, L, ...]``) into ``out`` (``[n, boundary, ...]``): cut or padded to the boundary,
    entries from each row's length on set to ``value``."""
    width = min(rows.shape[1], out.shape[1])
    out[:, :width] = rows[:, :width]
    out[:, width:] = value
    out[np.arange(out.shape[1])[None, :] >= lengths[:, None]] = value


def pad_rows(
    rows: Sequence[Mapping[str, Any]], lengths: np.ndarray, boundary: int, buckets: Buckets, indices: np.ndarray
) -> dict[str, np.ndarray]:
    """Examples read one by one (a record source, or after ``transform``) as one batch padded to ``boundary``.

    Raises:
      ValueError: an example lacks a padded field, or its sequence axis is shorter than its length, naming the
        example's index in the source.
    """
    padded = []
    for row, length, index in zip(rows, lengths.tolist(), indices.tolist(), strict=True):
        row = {k: np.asarray(v) for k, v in row.items()}
        for name, value in buckets.pad.items():
            if name not in row:
                raise ValueError(
                    f"`pad` names field {name!r}, but example {index} of the source has fields {sorted(row)}; name "
                    "the fields with a sequence axis."
                )
            array = row[name]
            if array.ndim == 0 or array.shape[0] < length:
                raise ValueError(
                    f"Field {name!r} of example {index} has shape {array.shape}, but the example's length is "
                    f"{length}: a padded field holds at least `length` entries along its first axis. Check `length` "
                    "(and that `transform` keeps the sequence's length)."
                )
            out = np.empty((1, boundary, *array.shape[1:]), array.dtype)
            fill(out, array[None], np.array([length]), pad_value(name, value, array.dtype))
            row[name] = out[0]
        if isinstance(buckets.length, str) and buckets.length in row:
            row[buckets.length] = np.asarray(length).astype(row[buckets.length].dtype)  # cut with too_long
        padded.append(row)
    return {k: np.stack([r[k] for r in padded]) for k in padded[0]}
