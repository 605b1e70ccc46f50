"""DataLoader: transforms on a dict of arrays, one read per block from one stream across epochs, and
``local_batches`` (the slices to the end of the epoch, its read-ahead stopped when it ends), against NumPy."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import jddp
from jddp.data import reading


def source(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "x": rng.integers(-50, 50, (n, 3)).astype(np.float32),  # small integers: exact under +1 and *2
        "y": rng.integers(0, 1000, n).astype(np.int32),
    }


def reference_rows(n: int, batch: int, seed: int, position: int, drop_last: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(indices, mask)`` of the global batch at ``position`` (one process), from the sampler's definitions."""
    per_epoch = n // batch if drop_last else -(-n // batch)
    epoch, b = divmod(position, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    places = b * batch + np.arange(batch)
    return order[places % n], (places < n).astype(np.float32)


def host(batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def add_one(example, rng):
    return {**example, "x": example["x"] + 1}


def double(batch, rng):
    return {**batch, "x": batch["x"] * 2}


@pytest.mark.parametrize(
    ("transform", "batch_transform", "expected"),
    [(add_one, None, lambda x: x + 1), (None, double, lambda x: 2 * x), (add_one, double, lambda x: 2 * (x + 1))],
    ids=["transform", "batch_transform", "both"],
)
def test_transforms_of_a_dict_of_arrays_are_what_the_loader_yields(transform, batch_transform, expected):
    """A dict of arrays with either transform (or both) yields the transformed rows, not the raw arrays."""
    data = source(40)
    loader = jddp.data.DataLoader(
        data,
        global_batch_size=16,
        seed=3,
        drop_last=False,
        transform=transform,
        batch_transform=batch_transform,
        prefetch=0,
    )
    batches = [host(b) for b in loader]
    assert len(batches) == 3
    for position, batch in enumerate(batches):
        indices, mask = reference_rows(40, 16, 3, position, drop_last=False)
        np.testing.assert_array_equal(batch["x"], expected(data["x"][indices]))
        np.testing.assert_array_equal(batch["y"], data["y"][indices])
        np.testing.assert_array_equal(batch["mask"], mask)


def test_one_stream_reads_each_block_once_across_epochs(monkeypatch):
    """Without read-ahead, two epochs read the blocks of 3 batches at their first positions, each once and in order:
    the stream is neither restarted between batches nor at the epoch boundary."""
    monkeypatch.setattr(reading, "READ_BYTES", 3 * 16 * 20)  # rows of 20 bytes (x 12, y 4, mask 4)
    reads: list[int] = []
    call = reading.ReadBatch.__call__

    def spy(self, first):
        reads.append(int(first))
        return call(self, first)

    monkeypatch.setattr(reading.ReadBatch, "__call__", spy)
    data = source(100)
    loader = jddp.data.DataLoader(data, global_batch_size=16, seed=5, drop_last=False, prefetch=0)
    assert loader._read.batches_per_read == 3 and len(loader) == 7
    batches = [host(b) for _ in range(2) for b in loader]
    assert reads == [0, 3, 6, 7, 10, 13]  # blocks of 3, 3 and 1 batches in each epoch of 7
    assert len(batches) == 14
    for position, batch in enumerate(batches):
        indices, mask = reference_rows(100, 16, 5, position, drop_last=False)
        np.testing.assert_array_equal(batch["x"], data["x"][indices])
        np.testing.assert_array_equal(batch["mask"], mask)


@pytest.mark.parametrize("read_bytes", [2 * 16 * 20, 1 << 20], ids=["blocks-of-2", "one-block"])
def test_local_batches_are_the_slices_to_the_end_of_the_epoch(monkeypatch, read_bytes):
    """``local_batches`` gives this process's NumPy slices from the position to the end of its epoch, and leaves the
    position where it was."""
    monkeypatch.setattr(reading, "READ_BYTES", read_bytes)
    data = source(100)
    loader = jddp.data.DataLoader(data, global_batch_size=16, seed=8, drop_last=False)
    loader.set_state({**loader.get_state(), "position": 9, "epoch": 1})  # epoch 1 of 7 batches, its batch 2
    got = list(loader.local_batches())
    assert len(got) == 5
    for position, batch in zip(range(9, 14), got, strict=True):
        indices, mask = reference_rows(100, 16, 8, position, drop_last=False)
        assert isinstance(batch["x"], np.ndarray) and batch["x"].dtype == np.float32
        np.testing.assert_array_equal(batch["x"], data["x"][indices])
        np.testing.assert_array_equal(batch["y"], data["y"][indices])
        np.testing.assert_array_equal(batch["mask"], mask)
    assert loader.get_state()["position"] == 9


def test_an_error_that_ends_local_batches_stops_its_read_ahead(monkeypatch):
    """When an error ends ``local_batches``, its read-ahead thread is stopped at once, even while the error (whose
    traceback keeps the generator's frame) is still held."""
    monkeypatch.setattr(reading, "READ_BYTES", 1)  # one batch per read: 50 reads, more than the buffer holds
    loader = jddp.data.DataLoader(source(400), global_batch_size=8, shuffle=False, prefetch=2)
    before = set(threading.enumerate())
    batches = loader.local_batches()
    next(batches)
    assert set(threading.enumerate()) - before, "no read-ahead thread: the test shows nothing"
    with pytest.raises(RuntimeError, match="consumer stopped") as info:
        batches.throw(RuntimeError("consumer stopped"))
    assert not set(threading.enumerate()) - before
    assert info.value.__traceback__ is not None


class Records:
    """A random-access source of dicts whose record 0 is fine (the loader checks it when built) and whose later
    records may hold a string field or a mask value of 2."""

    def __init__(self, bad: str | None = None):
        self.bad = bad

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        record = {"x": np.float32(i), "name": np.int32(0), "mask": np.float32(1)}
        if i and self.bad == "name":
            record["name"] = "a"
        if i and self.bad == "mask":
            record["mask"] = np.float32(2)
        return record


def test_a_bad_field_of_a_later_record_is_named_and_blamed_on_the_source():
    """Record 0 passes the check at construction; a later record's string field and mask of 2, found when the batch
    is read, are named with the field and "the source" (no transform)."""
    data = jddp.data.DataLoader(Records("name"), global_batch_size=16, shuffle=False, prefetch=0)
    with pytest.raises(TypeError, match=r"^DataLoader field 'name' of the source has dtype <U"):
        next(iter(data))
    data = jddp.data.DataLoader(Records("mask"), global_batch_size=16, shuffle=False, prefetch=0)
    with pytest.raises(ValueError, match=r"^The 'mask' field of the source must be 0 or 1, got 2\.0"):
        next(iter(data))


def to_text(example, rng):
    return {**example, "name": "a"}


def to_texts(batch, rng):
    return {**batch, "name": np.array(["a"] * len(batch["x"]))}


def mask_of_twos(batch, rng):
    return {**batch, "mask": np.full(len(batch["x"]), 2.0, np.float32)}


@pytest.mark.parametrize(
    ("transform", "batch_transform"),
    [(to_text, None), (None, to_texts), (add_one, to_texts)],
    ids=["transform", "batch_transform", "both"],
)
def test_a_bad_field_made_by_a_transform_is_blamed_on_the_transforms(transform, batch_transform):
    """With either transform (or both) a string field they return is named with "the transforms", not the source."""
    data = jddp.data.DataLoader(
        source(32), global_batch_size=16, transform=transform, batch_transform=batch_transform, prefetch=0
    )
    with pytest.raises(TypeError, match=r"^DataLoader field 'name' of the transforms has dtype <U"):
        next(iter(data))


def test_a_bad_mask_made_by_a_batch_transform_is_blamed_on_the_transforms():
    data = jddp.data.DataLoader(source(32), global_batch_size=16, batch_transform=mask_of_twos, prefetch=0)
    with pytest.raises(ValueError, match=r"^The 'mask' field of the transforms must be 0 or 1, got 2\.0"):
        next(iter(data))
