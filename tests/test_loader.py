"""DataLoader: global batches, exact resume, exact evaluation, transforms, workers."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jddp
from jddp.data import reading
from jddp.data.sampler import DistributedBatchSampler
from tests import models


def source(n: int = 203) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(n, models.IN)).astype(np.float32),
        "y": rng.integers(0, models.OUT, n).astype(np.int32),
    }


def host(batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def test_batches_are_global_arrays_of_the_sampler_rows():
    data = source()
    loader = jddp.data.DataLoader(data, global_batch_size=32, seed=5, shuffle=True)
    reference = DistributedBatchSampler(len(data["x"]), global_batch_size=32, seed=5)
    batches = list(loader)
    assert len(batches) == len(loader) == 203 // 32
    for position, batch in enumerate(batches):
        assert batch.data.sharding == jddp.batch_sharding(jddp.data_mesh())
        idx = reference.local_batch(position).indices
        np.testing.assert_array_equal(np.asarray(batch["x"]), data["x"][idx])
        np.testing.assert_array_equal(np.asarray(batch["y"]), data["y"][idx])
        np.testing.assert_array_equal(np.asarray(batch["mask"]), np.ones(32, np.float32))
    assert loader.epoch == 1


@pytest.mark.parametrize("stop", [0, 3, 6, 9], ids=["start", "mid-epoch", "epoch-end", "second-epoch"])
@pytest.mark.parametrize("devices", [8, 4, 2], ids=["8dev", "4dev", "2dev"])
def test_resume_continues_the_uninterrupted_sequence(stop, devices):
    data = source(100)
    kwargs = {"global_batch_size": 16, "seed": 11, "drop_last": False}
    uninterrupted = jddp.data.DataLoader(data, **kwargs)
    full = [host(b) for _ in range(3) for b in uninterrupted]  # 3 epochs of 7 batches

    first = jddp.data.DataLoader(data, **kwargs)
    taken = []
    while len(taken) < stop:
        for b in first:
            taken.append(host(b))
            if len(taken) == stop:
                break
    state = first.get_state()
    resumed = jddp.data.DataLoader(data, mesh=jddp.data_mesh(jax.devices()[:devices]), **kwargs)
    resumed.set_state(state)
    rest = []
    while resumed.epoch < 3:  # each pass runs to the end of the current epoch
        rest.extend(host(b) for b in resumed)
    assert len(taken) + len(rest) == len(full)
    for a, b in zip(taken + rest, full, strict=True):
        for k in b:
            np.testing.assert_array_equal(a[k], b[k])


def test_evaluation_over_a_ragged_dataset_equals_one_device():
    model = models.pytree()
    data = source(203)  # not a multiple of the batch
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
    state = dp.init(model.params)
    loader = jddp.data.DataLoader(data, global_batch_size=64, shuffle=False, drop_last=False)
    metrics = dp.evaluate(state, loader)
    loss, (_, aux) = model.loss_fn(model.params, {}, data, None)
    assert metrics["examples"] == 203
    assert metrics["loss"] == pytest.approx(float(loss), abs=1e-6)
    assert metrics["accuracy"] == pytest.approx(float(aux["accuracy"]), abs=1e-7)
    # Averaging per-batch means without weights (what a plain loop does) is off.
    plain = np.mean(
        [
            dp.eval_step(state, b)["loss"]
            for b in jddp.data.DataLoader(data, global_batch_size=64, shuffle=False, drop_last=False)
        ]
    )
    assert abs(plain - float(loss)) > 1e-4


def test_weighted_metrics_combine_exactly_across_batches():
    data = source(50)

    def eval_fn(params, model_state, batch):
        per_example = batch["x"][:, 0] * batch["mask"]
        # A Weighted metric whose weight is not the example count.
        return {"w": jddp.Weighted(per_example.sum(), 2.0 * batch["mask"].sum())}

    dp = jddp.DataParallel(lambda *a: None, optax.sgd(0.1), mesh=jddp.data_mesh(), eval_fn=eval_fn)
    state = dp.init({"w": np.zeros(1, np.float32)})
    loader = jddp.data.DataLoader(data, global_batch_size=16, shuffle=False, drop_last=False)
    metrics = dp.evaluate(state, loader)
    assert metrics["w"] == pytest.approx(data["x"][:, 0].sum() / 100, abs=1e-6)


def double_with_noise(example, rng):
    return {**example, "x": example["x"] * 2 + rng.normal(size=example["x"].shape).astype(np.float32)}


def test_per_example_transform_does_not_depend_on_the_process_count():
    data = source(64)
    one = DistributedBatchSampler(64, global_batch_size=16, seed=1)
    read_one = reading.ReadBatch(data, one, double_with_noise, None).batch
    for position in (0, 5):
        whole = read_one(position)
        parts = []
        for rank in range(4):
            s = DistributedBatchSampler(64, global_batch_size=16, seed=1, num_replicas=4, rank=rank)
            parts.append(reading.ReadBatch(data, s, double_with_noise, None).batch(position))
        np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), whole["x"])
        assert not np.allclose(whole["x"], 2 * data["x"][one.local_batch(position).indices])


def noise_of(example, rng):
    return {**example, "noise": np.float64(rng.normal())}


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_the_same_example_draws_new_randomness_every_epoch(shuffle):
    """An example's transform ``rng`` changes with the epoch (also when the order does not) and repeats on a re-read."""
    data = {**source(64), "id": np.arange(64, dtype=np.int32)}
    sampler = DistributedBatchSampler(64, global_batch_size=16, seed=1, shuffle=shuffle)
    read = reading.ReadBatch(data, sampler, noise_of, None).batch

    def epoch_noise(epoch: int) -> np.ndarray:
        batches = [read(epoch * len(sampler) + b) for b in range(len(sampler))]
        ids = np.concatenate([b["id"] for b in batches])
        noise = np.concatenate([b["noise"] for b in batches])
        return noise[np.argsort(ids)]  # by example

    first, second = epoch_noise(0), epoch_noise(1)
    assert len(np.unique(first)) == 64  # every example its own draw
    assert not np.any(first == second)  # and a new one every epoch
    np.testing.assert_array_equal(epoch_noise(0), first)  # re-reading an epoch repeats it


def jitter(batch, rng):
    return {**batch, "x": batch["x"] + rng.normal(size=batch["x"].shape).astype(np.float32)}


def test_batch_transform_gets_a_generator_of_seed_position_and_process():
    """Its output is what the step sees; its rng repeats on a re-read and changes with the position."""
    data = source(64)
    sampler = DistributedBatchSampler(64, global_batch_size=16, seed=1, num_replicas=2, rank=1)
    read = reading.ReadBatch(data, sampler, None, jitter).batch
    first, again, later = read(0), read(0), read(4)
    np.testing.assert_array_equal(first["x"], again["x"])
    rows = data["x"][sampler.local_batch(0).indices]
    expected = rows + np.random.default_rng([1, 0, 1]).normal(size=rows.shape).astype(np.float32)
    np.testing.assert_array_equal(first["x"], expected)
    assert not np.array_equal(later["x"] - data["x"][sampler.local_batch(4).indices], first["x"] - rows)


def test_plain_arrays_and_records_are_read_as_x():
    x = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(reading.read(x, np.array([3, 1]))["x"], [3.0, 1.0])
    np.testing.assert_array_equal(reading.read(list(x), np.array([2]))["x"], [2.0])


class CountingSource:
    """A Grain-style random-access source that counts its reads."""

    def __init__(self, n: int):
        self.data = source(n)
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.data["x"])

    def __getitem__(self, i: int) -> dict:
        self.reads.append(i)
        return {k: v[i] for k, v in self.data.items()}

    def __repr__(self) -> str:
        return f"CountingSource(n={len(self)})"


def test_record_source_reads_each_example_once_per_epoch():
    src = CountingSource(40)
    loader = jddp.data.DataLoader(src, global_batch_size=8, seed=2, prefetch=0)
    assert src.reads == [0]  # construction reads one record to check its fields' dtypes
    src.reads.clear()
    batches = [host(b) for b in loader]
    assert sorted(src.reads) == list(range(40))
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), src.data["x"][np.array(src.reads)])


def mixed_source(n: int) -> dict[str, np.ndarray]:
    """Fields of every alignment: the packed rows need padding between them."""
    rng = np.random.default_rng(3)
    return {
        "flag": rng.random(n) < 0.5,
        "x": rng.normal(size=(n, 2, 3)).astype(np.float32),
        "small": rng.integers(-100, 100, (n, 5)).astype(np.int8),
        "y": rng.integers(0, 60_000, n).astype(np.uint16),
        "z": rng.normal(size=n).astype(np.float32),
    }


@pytest.mark.parametrize("read_bytes", [1, 2200, 1 << 20], ids=["1-batch-reads", "3-batch-reads", "whole-epoch"])
def test_blocks_of_any_size_give_the_sampler_rows(monkeypatch, read_bytes):
    monkeypatch.setattr(reading, "READ_BYTES", read_bytes)
    data = mixed_source(70)
    loader = jddp.data.DataLoader(data, global_batch_size=16, seed=3, drop_last=False, prefetch=1)
    reference = DistributedBatchSampler(70, global_batch_size=16, seed=3, drop_last=False)
    assert loader._read.batches_per_read == {1: 1, 2200: 3, 1 << 20: 16}[read_bytes]  # rows of 44 bytes
    batches = [host(b) for _ in range(2) for b in loader]  # two epochs of 5 batches
    assert len(batches) == 10
    for position, batch in enumerate(batches):
        ref = reference.local_batch(position)
        for k, v in data.items():
            assert batch[k].dtype == v.dtype
            np.testing.assert_array_equal(batch[k], v[ref.indices])
        np.testing.assert_array_equal(batch["mask"], ref.mask)
    assert all(f.start % np.dtype(f.dtype).itemsize == 0 for f in loader._read.layout)  # aligned fields


def test_array_and_record_sources_give_the_same_bytes():
    data = source(90)
    records = CountingSource(90)
    fast = jddp.data.DataLoader(data, global_batch_size=16, seed=6, drop_last=False)
    slow = jddp.data.DataLoader(records, global_batch_size=16, seed=6, drop_last=False)
    assert fast._read.arrays is not None and slow._read.arrays is None
    for a, b in zip(fast, slow, strict=True):
        assert a.layout == b.layout
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))


def test_direct_transfer_equals_device_put():
    loader = jddp.data.DataLoader(source(64), global_batch_size=32)
    assert loader._transfer._put is not None, "JAX's batched_device_put moved; the loader fell back to device_put"
    data = np.random.default_rng(0).integers(0, 256, (32, 24)).astype(np.uint8)
    got, want = loader._transfer(data), jax.device_put(data, loader._sharding)
    assert got.sharding == want.sharding and got.shape == want.shape
    for a, b in zip(got.addressable_shards, want.addressable_shards, strict=True):
        assert a.device == b.device and a.index == b.index
        np.testing.assert_array_equal(np.asarray(a.data), np.asarray(b.data))
    with pytest.raises(ValueError, match=r"Expected 32 local rows for the batch, got 8"):
        loader._transfer(data[:8])


@pytest.mark.parametrize("transform", [None, double_with_noise], ids=["arrays", "transform"])
@pytest.mark.multiprocess  # starts a process of its own
def test_worker_processes_give_the_same_batches(monkeypatch, transform):
    monkeypatch.setattr(reading, "READ_BYTES", 3000)  # several blocks per worker
    data = source(96)
    kwargs = {"global_batch_size": 16, "seed": 4, "transform": transform}
    reference = jddp.data.DataLoader(data, **kwargs)
    expected = [host(b) for _ in range(2) for b in reference]
    loader = jddp.data.DataLoader(data, worker_count=2, **kwargs)
    got, streams = [], []
    for _ in range(2):  # two epochs from the same workers: they are not restarted per epoch
        got.extend(host(b) for b in loader)
        streams.append(loader._stream.box[0])
    assert streams[0] is streams[1] is not None
    loader.close()
    assert loader._stream.box[0] is None
    assert len(got) == len(expected) == 12
    for a, b in zip(got, expected, strict=True):
        for k in b:
            np.testing.assert_array_equal(a[k], b[k])


def test_stream_restarts_where_the_position_moved():
    data = source(100)
    loader = jddp.data.DataLoader(data, global_batch_size=16, seed=2, drop_last=False)
    reference = DistributedBatchSampler(100, global_batch_size=16, seed=2, drop_last=False)
    it = iter(loader)
    next(it), next(it)
    loader.set_epoch(3)  # jumps: the stream read ahead from position 2 must not be used
    first = next(iter(loader))
    np.testing.assert_array_equal(np.asarray(first["x"]), data["x"][reference.local_batch(21).indices])
    state = loader.get_state()
    assert state["position"] == 22 and state["epoch"] == 3


def test_trains_like_pre_staged_batches():
    model = models.pytree()
    data = source(128)
    loader = jddp.data.DataLoader(data, global_batch_size=32, seed=9)
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
    state = dp.init(model.params)
    for batch in loader:
        state, _ = dp.step(state, batch)
    sampler = DistributedBatchSampler(128, global_batch_size=32, seed=9)
    staged = [{**{k: v[b.indices] for k, v in data.items()}, "mask": b.mask} for b in sampler]
    ref, _ = models.reference_sgd(model, staged, 0.1)
    assert models.max_diff(state.params, ref) < 1e-6


@pytest.mark.parametrize(
    ("src", "kwargs", "error", "match"),
    [
        (
            {"x": np.zeros((40, 2))},
            {"global_batch_size": 12},
            ValueError,
            r"global_batch_size=12, processes=1, devices=8.*multiple of 8",
        ),
        ({"x": np.zeros((0, 2))}, {"global_batch_size": 8}, ValueError, r"source is empty"),
        ({"x": np.zeros((5, 2))}, {"global_batch_size": 8}, ValueError, r"dataset_size=5, global_batch_size=8"),
        ({"x": np.zeros((5, 2)), "y": np.zeros(4)}, {"global_batch_size": 8}, ValueError, r"same length"),
        (object(), {"global_batch_size": 8}, TypeError, r"support `len\(\)` and indexing"),
        ({"x": np.zeros((16, 2))}, {"global_batch_size": 8, "worker_count": -1}, ValueError, r"worker_count=-1"),
        ({"x": np.zeros((16, 2))}, {"global_batch_size": 8, "transform": "norm"}, TypeError, r"`transform` must be"),
        (
            {"x": np.zeros((16, 2))},
            {"global_batch_size": 8, "batch_transform": {"f": len}},
            TypeError,
            r"`batch_transform` must be a function batch_transform\(batch, rng\) -> batch, or None",
        ),
        ({"x": np.zeros((16, 2))}, {"global_batch_size": 8, "shuffle": "no"}, TypeError, r"`shuffle` must be True"),
        # PyTorch's TensorDataset habit, one level up: (source, batch size) as the source, 2 "examples"
        (({"x": np.zeros((16, 2))}, 8), {"global_batch_size": 8}, ValueError, r"`source` is smaller than one"),
    ],
    ids=[
        "indivisible",
        "empty",
        "smaller-than-batch",
        "ragged-source",
        "no-len",
        "workers",
        "transform",
        "batch-transform",
        "shuffle-str",
        "tuple-source",
    ],
)
def test_bad_arguments(src, kwargs, error, match):
    with pytest.raises(error, match=match):
        jddp.data.DataLoader(src, **kwargs)


def test_skip_and_set_state_refuse_wrong_values_before_moving():
    loader = jddp.data.DataLoader(source(100), global_batch_size=16, seed=1)
    with pytest.raises(ValueError, match=r"`timeout_s` must be a finite number > 0.0 \(seconds\), got timeout_s=nan"):
        loader.skip(2, timeout_s=float("nan"))
    with pytest.raises(TypeError, match=r"`state` must be the dict that `state_dict\(\)` \(or DataLoader.get_state"):
        loader.set_state(None)
    assert loader.get_state()["position"] == 0 and loader.get_state()["skipped"] == []


def test_iterating_consumes_and_local_batches_peeks():
    """What the loader's docstring and the data guide say: a batch handed out by iteration advances the position
    (``next(iter(loader))`` too); ``to_global(next(iter(local_batches())))`` is the same batch, position kept."""
    loader = jddp.data.DataLoader(source(), global_batch_size=32, seed=5)
    peek = loader.to_global(next(iter(loader.local_batches())))
    assert loader.get_state()["position"] == 0
    taken = next(iter(loader))
    assert loader.get_state()["position"] == 1
    assert host(peek).keys() == host(taken).keys()
    for key in host(taken):
        np.testing.assert_array_equal(np.asarray(peek[key]), np.asarray(taken[key]))
    rest = list(loader)  # the epoch goes on from there: one batch fewer
    assert len(rest) == len(loader) - 1 and loader.epoch == 1


def deleted() -> jax.Array:
    x = jax.numpy.ones((32, models.IN))
    x.delete()
    return x


@pytest.mark.parametrize(
    ("local", "error", "match"),
    [
        (None, TypeError, r"`local` must be what local_batches\(\) yields: a dict of arrays .*got NoneType"),
        ([{"x": np.zeros((32, 2))}], TypeError, r"got list"),
        ({}, ValueError, r"`local` must be .*, got an empty mapping"),
        ({"x": np.zeros((32, 2)), "y": np.zeros(16)}, ValueError, r"must hold this process's 32 rows .*'y': 16"),
        ({"x": np.zeros((3, 2))}, ValueError, r"`local` must hold this process's 32 rows in every array .*'x': 3"),
        ({"x": np.float32(1.0)}, TypeError, r"got shape \(\) at 'x'"),
        ({"x": np.array(["a"] * 32)}, TypeError, r"field 'x' of `local` has dtype <U1 \(strings\)"),
        ({"x": deleted()}, ValueError, r"`local` holds a deleted jax.Array at 'x'"),
    ],
    ids=["none", "list", "empty", "mismatched", "rows", "scalar", "strings", "deleted"],
)
def test_to_global_refuses_what_local_batches_does_not_yield_naming_local(local, error, match):
    loader = jddp.data.DataLoader(source(), global_batch_size=32, seed=5)
    with pytest.raises(error, match=match):
        loader.to_global(local)


def test_state_from_another_dataset_is_refused():
    loader = jddp.data.DataLoader(source(100), global_batch_size=16, seed=1)
    state = loader.get_state()
    other = jddp.data.DataLoader(source(120), global_batch_size=16, seed=1)
    with pytest.raises(ValueError, match=r"dataset_size: saved 100, here 120"):
        other.set_state(state)
    other = jddp.data.DataLoader(source(100), global_batch_size=16, seed=2)
    with pytest.raises(ValueError, match=r"seed: saved 1, here 2"):
        other.set_state(state)


# ------------------------------------------------------------- per_device_batch_size (PyTorch's batch_size)


def test_per_device_batch_size_gives_the_batches_of_its_global_batch_size():
    """PyTorch's ``DataLoader(batch_size=4)`` per process-device, on 8 devices: the global batch of 32."""
    assert jax.device_count() == 8
    data = source()
    per_device = jddp.data.DataLoader(data, per_device_batch_size=4, seed=5)
    global_ = jddp.data.DataLoader(data, global_batch_size=32, seed=5)
    assert per_device.global_batch_size == global_.global_batch_size == 32
    assert per_device.per_device_batch_size == global_.per_device_batch_size == 4
    assert len(per_device) == len(global_) == 203 // 32
    for epoch in range(2):
        got, want = [host(b) for b in per_device], [host(b) for b in global_]
        assert len(got) == len(want) == 6, epoch
        for a, b in zip(got, want, strict=True):
            assert a.keys() == b.keys()
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
    assert per_device.get_state() == global_.get_state()


def test_per_device_batch_size_counts_the_devices_of_the_mesh():
    mesh = jddp.data_mesh(jax.devices()[:2])
    loader = jddp.data.DataLoader(source(), per_device_batch_size=3, mesh=mesh, shuffle=False)
    assert loader.global_batch_size == 6 and loader.per_device_batch_size == 3
    assert np.asarray(next(iter(loader))["x"]).shape == (6, models.IN)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"global_batch_size": 32, "per_device_batch_size": 4},
            r"both.*global_batch_size=32.*per_device_batch_size=4",
        ),
        ({}, r"neither"),
        ({"per_device_batch_size": 0}, r"`per_device_batch_size` must be an int >= 1, got per_device_batch_size=0\b"),
        (
            {"per_device_batch_size": 2.5},
            r"must be an int >= 1, got per_device_batch_size=2\.5",
        ),
    ],
    ids=["both", "neither", "zero", "float"],
)
def test_batch_size_arguments_exactly_one_of_the_two(kwargs, match):
    with pytest.raises(ValueError, match=match) as error:
        jddp.data.DataLoader(source(), **kwargs)
    if "both" in match or "neither" in match:  # names both, and the fix
        assert "`global_batch_size`" in str(error.value) and "`per_device_batch_size`" in str(error.value)


def test_steps_converts_epochs_to_the_steps_every_setting_counts():
    data = {"x": np.zeros((160, 3), np.float32)}
    loader = jddp.data.DataLoader(data, global_batch_size=16, seed=0)
    assert (loader.steps(epochs=3), loader.steps(epochs=0.5), loader.steps(epochs=1)) == (30, 5, len(loader))
    padded = jddp.data.DataLoader(data, global_batch_size=48, seed=0, drop_last=False)  # 4 steps, the last padded
    assert padded.steps(epochs=2) == 8
    for bad in (0, -1, float("nan"), float("inf"), "2", True, None):
        with pytest.raises(ValueError, match=r"`epochs` must be a positive number of epochs, got epochs="):
            loader.steps(epochs=bad)
    with pytest.raises(ValueError, match=r"less than one step of this loader \(10 steps per epoch\)"):
        loader.steps(epochs=0.01)


# ------------------------------------------------------------- max_per_device_batch_size (the same batch anywhere)


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 8), st.integers(1, 40), st.integers(1, 9), st.booleans())
@example(devices=3, batch=16, limit=2, drop_last=False)  # k = 3 (2 rows would need 3 micro-batches, not 2)
def test_max_per_device_pads_to_the_fewest_micro_batches_and_keeps_the_examples(devices, batch, limit, drop_last):
    mesh = jddp.data_mesh(jax.devices()[:devices])
    data = source(45)
    kwargs = {"global_batch_size": batch, "seed": 2, "drop_last": drop_last, "prefetch": 0}
    loader = jddp.data.DataLoader(data, max_per_device_batch_size=limit, mesh=mesh, **kwargs)
    k, padded = loader.accumulate_steps, loader.padded_batch_size
    micro = padded // (devices * k)
    assert padded == devices * k * micro and micro <= limit and padded >= batch
    assert k == 1 or -(-batch // (devices * (k - 1))) > limit  # no fewer micro-batches would do
    assert micro == -(-batch // (devices * k))  # and they are as small as they can be: padding < devices * k
    assert (loader.global_batch_size, loader.per_device_batch_size) == (batch, padded // devices)
    plain = jddp.data.DataLoader(data, mesh=jddp.data_mesh(jax.devices()[:1]), **kwargs)
    for a, b in zip(itertools.islice(loader, 2), itertools.islice(plain, 2), strict=True):
        a, b = host(a), host(b)
        assert a["x"].shape == (padded, models.IN) and not a["mask"][batch:].any()
        np.testing.assert_array_equal(a["mask"][:batch], b["mask"])
        np.testing.assert_array_equal(a["x"][:batch][b["mask"] == 1], b["x"][b["mask"] == 1])


def test_an_indivisible_batch_names_max_per_device_batch_size_and_bad_limits_are_refused():
    mesh = jddp.data_mesh(jax.devices()[:3])
    with pytest.raises(ValueError, match=r"global_batch_size=16, .*devices=3.*pass `max_per_device_batch_size`"):
        jddp.data.DataLoader(source(), global_batch_size=16, mesh=mesh)
    for bad in (0, 2.5, True, "4"):
        with pytest.raises(ValueError, match=r"`max_per_device_batch_size` must be an int >= 1 or None, got "):
            jddp.data.DataLoader(source(), global_batch_size=16, mesh=mesh, max_per_device_batch_size=bad)
    # per_device_batch_size with a limit: the rows a device takes per step, in limit-sized micro-batches.
    loader = jddp.data.DataLoader(source(), per_device_batch_size=6, mesh=mesh, max_per_device_batch_size=4)
    assert (loader.global_batch_size, loader.accumulate_steps, loader.padded_batch_size) == (18, 2, 18)
    assert loader.per_device_batch_size == 6
