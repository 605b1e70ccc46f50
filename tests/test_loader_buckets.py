"""DataLoader(..., buckets=...): bucketed global batches on any world size, padded per field, resumable, one shape
(one compiled step) per bucket.

Every batch is compared with an independent NumPy reference: the rows the one-replica sampler names, cut to the
batch's boundary, entries past each example's length set to the padding value. Processes are simulated in one
process as the sampler tests do: ``R`` readers (``ReadBatch`` over the sampler of rank ``r`` of ``R``) whose slices,
concatenated, must be the reference; device counts with meshes of 1, 2, 4 and 8 devices.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.data import reading
from jddp.data.buckets import BucketedBatchSampler, Buckets
from jddp.runtime import packing
from tests import models

MAX_LEN, PAD, SEED = 60, -1, 4
BUCKETS = Buckets(boundaries=(8, 16, 32, 64), length="length", pad={"tokens": PAD, "labels": 0.5})


def sst_like(n: int = 150, seed: int = 0) -> dict[str, np.ndarray]:
    """SST-2-like sentences: lengths mostly under 30 tokens, a tail to 60; stored padded with zeros to 60."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(2.8, 0.5, n).astype(np.int64), 1, MAX_LEN)
    tokens = np.zeros((n, MAX_LEN), np.int32)
    labels = np.zeros((n, MAX_LEN, 2), np.float32)  # a per-token field of two values
    for i, length in enumerate(lengths):
        tokens[i, :length] = rng.integers(1, 1000, length)
        labels[i, :length] = rng.random((length, 2))
    return {
        "tokens": tokens,
        "labels": labels,
        "length": lengths.astype(np.int32),
        "y": rng.integers(0, 2, n).astype(np.int32),
    }


class Records:
    """The same sentences as unpadded records (a Grain-style source): each ``tokens`` as long as its sentence."""

    def __init__(self, data: dict[str, np.ndarray]):
        self.data = data

    def __len__(self) -> int:
        return len(self.data["y"])

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        n = int(self.data["length"][i])
        return {"tokens": self.data["tokens"][i, :n], "labels": self.data["labels"][i, :n], "y": self.data["y"][i]}

    def __repr__(self) -> str:
        return "Records()"


def expected(data, lengths, sampler, position, buckets=BUCKETS) -> dict[str, np.ndarray]:
    """The reference: the global batch at ``position`` from the sampler's rows and NumPy."""
    indices, mask, _ = sampler.global_batch(position)
    boundary = sampler.boundary_at(position)
    out = {"mask": mask, "y": data["y"][indices].astype(np.int32)}
    past = np.arange(boundary)[None, :] >= lengths[indices][:, None]
    for name, value in buckets.pad.items():
        field = np.zeros((len(indices), boundary, *data[name].shape[2:]), data[name].dtype)
        width = min(boundary, data[name].shape[1])
        field[:, :width] = data[name][indices, :width]
        field[past] = value
        out[name] = field
    return out


def host(batch) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in batch.items()}


def check(batch: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for k, v in want.items():
        assert batch[k].shape == v.shape, (k, batch[k].shape, v.shape)
        np.testing.assert_array_equal(batch[k], v, err_msg=k)


def sources(data):
    length_fn = {"length": lambda example: len(example["tokens"])}
    identity = {"transform": lambda example, rng: example}
    return {
        "arrays": (data, {}),  # the fast path: blocks gathered by NumPy
        "records-length-fn": (Records(data), length_fn),  # ragged records, lengths from a function
        "arrays-transform": (data, identity),  # example by example
    }


@pytest.mark.parametrize("kind", ["arrays", "records-length-fn", "arrays-transform"])
@pytest.mark.parametrize("drop_last", [False, True], ids=["pad-rest", "drop-rest"])
def test_processes_slices_assemble_the_reference_batches(kind, drop_last):
    data = sst_like()
    source, options = sources(data)[kind]
    buckets = Buckets(**{**vars(BUCKETS), "length": options.get("length", "length")})
    transform = options.get("transform")
    lengths = reading.lengths(source, buckets)
    np.testing.assert_array_equal(lengths, data["length"])
    one = BucketedBatchSampler(lengths, buckets, global_batch_size=12, seed=SEED, drop_last=drop_last)
    for replicas in (1, 2, 4):
        readers = [
            reading.ReadBatch(
                source,
                BucketedBatchSampler(
                    lengths,
                    buckets,
                    global_batch_size=12,
                    seed=SEED,
                    drop_last=drop_last,
                    num_replicas=replicas,
                    rank=r,
                ),
                transform,
                None,
            )
            for r in range(replicas)
        ]
        for position in range(2 * len(one)):  # two epochs
            parts = []
            for read in readers:
                first, block, layout = read(position)
                assert first == position and block.shape[0] == 1  # one batch per read: shapes differ by bucket
                parts.append(packing.host_views(block[0], layout))
            batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            check(batch, expected(data, lengths, one, position))


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_the_loader_gives_the_same_global_batches_on_any_device_count(devices):
    data = sst_like()
    mesh = jddp.data_mesh(jax.devices()[:devices])
    loader = jddp.data.DataLoader(data, global_batch_size=16, seed=SEED, drop_last=False, buckets=BUCKETS, mesh=mesh)
    one = BucketedBatchSampler(data["length"], BUCKETS, global_batch_size=16, seed=SEED, drop_last=False)
    batches = [host(b) for _ in range(2) for b in loader]
    assert len(batches) == 2 * len(one) and loader.epoch == 2
    for position, batch in enumerate(batches):
        check(batch, expected(data, data["length"], one, position))
        assert batch["length"].max() <= batch["tokens"].shape[1]
    # each epoch: every example exactly once among the real rows
    per_epoch = len(one)
    for e in range(2):
        seen = np.concatenate(
            [one.global_batch(p)[0][one.global_batch(p)[1] > 0] for p in range(e * per_epoch, (e + 1) * per_epoch)]
        )
        np.testing.assert_array_equal(np.sort(seen), np.arange(len(data["y"])))


def test_distinct_shapes_are_the_buckets_used():
    data = sst_like(300)
    loader = jddp.data.DataLoader(data, global_batch_size=16, seed=SEED, buckets=BUCKETS)
    shapes = {(b["tokens"].shape, b["labels"].shape, b["y"].shape) for _ in range(3) for b in loader}
    counts = np.bincount(np.searchsorted(BUCKETS.boundaries, data["length"]), minlength=len(BUCKETS.boundaries))
    used = [b for b, n in zip(BUCKETS.boundaries, counts, strict=True) if n >= 16]  # drop_last: whole batches only
    assert len(used) >= 3
    assert sorted(s[0][1] for s in shapes) == used
    assert all(s == ((16, b), (16, b, 2), (16,)) for s, b in zip(sorted(shapes), used, strict=True))


@pytest.mark.parametrize("stop", [3, 9, 14], ids=["mid-epoch", "epoch-end", "second-epoch"])
@pytest.mark.parametrize("devices", [2, 4], ids=["to-2dev", "to-4dev"])
def test_resume_from_a_mid_epoch_state_on_another_device_count(stop, devices):
    data = sst_like()
    kwargs = {"global_batch_size": 16, "seed": SEED, "drop_last": False, "buckets": BUCKETS}
    uninterrupted = jddp.data.DataLoader(data, **kwargs)
    full = [host(b) for _ in range(3) for b in uninterrupted]
    first = jddp.data.DataLoader(data, **kwargs)
    taken = []
    while len(taken) < stop:
        for b in first:
            taken.append(host(b))
            if len(taken) == stop:
                break
    state = first.get_state()
    assert state["buckets"]["boundaries"] == [8, 16, 32, 64]
    resumed = jddp.data.DataLoader(data, mesh=jddp.data_mesh(jax.devices()[:devices]), **kwargs)
    resumed.set_state(state)
    rest = []
    while resumed.epoch < 3:
        rest.extend(host(b) for b in resumed)
    assert len(taken) + len(rest) == len(full)
    for a, b in zip(taken + rest, full, strict=True):
        check(a, b)


@pytest.mark.parametrize("transform", [None, lambda example, rng: example], ids=["arrays", "example-by-example"])
def test_truncate_cuts_long_examples_and_their_length_field(transform):
    data = sst_like()
    short = Buckets(boundaries=(10, 20), length="length", pad={"tokens": PAD, "labels": 0.5}, too_long="truncate")
    assert data["length"].max() > 20
    kwargs = {"shuffle": False, "drop_last": False, "transform": transform}
    loader = jddp.data.DataLoader(data, global_batch_size=8, buckets=short, **kwargs)
    cut = np.minimum(data["length"], 20)
    one = BucketedBatchSampler(cut, short, global_batch_size=8, shuffle=False, drop_last=False)
    for position, batch in enumerate(loader):
        batch = host(batch)
        check(batch, expected(data, cut, one, position, short))
        indices = one.global_batch(position)[0]
        np.testing.assert_array_equal(batch["length"], cut[indices])


def test_masked_rows_and_padding_per_field():
    data = sst_like(37)
    loader = jddp.data.DataLoader(data, global_batch_size=8, seed=1, drop_last=False, buckets=BUCKETS)
    for batch in loader:
        batch = host(batch)
        real = batch["mask"] > 0
        assert real.sum() >= 1
        past = np.arange(batch["tokens"].shape[1])[None] >= batch["length"][:, None]
        assert (batch["tokens"][past] == PAD).all() and (batch["tokens"][~past] > 0).all()
        assert (batch["labels"][past] == 0.5).all()


@pytest.mark.slow
def test_a_step_compiles_once_per_bucket_and_trains_as_one_device():
    """The engine compiles a step's programs exactly when a batch has a shape not seen before (one bucket), the same
    number for each, and nothing after; 8 devices give one device's losses."""
    data = sst_like(120)
    losses = {}
    for devices in (1, 8):
        mesh = jddp.data_mesh(jax.devices()[:devices])
        loader = jddp.data.DataLoader(data, global_batch_size=16, seed=SEED, buckets=BUCKETS, mesh=mesh)
        dp = jddp.DataParallel(bag_of_tokens_loss, optax.sgd(0.1), mesh=mesh)
        emb = np.random.default_rng(0).normal(size=(1000, 4)).astype(np.float32) * 0.1
        state = dp.init({"emb": emb, "w": np.zeros((4, 2), np.float32)})
        shapes, out, new = [], [], []
        with models.counting_compiles() as compiles:
            for _ in range(2):
                for batch in loader:
                    shape = next(f.shape for f in batch.layout if f.name == "tokens")  # no unpacking here
                    before = len(compiles)
                    state, metrics = dp.step(state, batch)
                    out.append(float(metrics["loss"]))
                    new.append((shape not in shapes, len(compiles) - before))
                    shapes.append(shape)
        assert [n > 0 for _, n in new] == [first for first, _ in new], new
        assert len({n for first, n in new if first}) == 1 and len(set(shapes)) >= 2, new
        assert {s[0] for s in shapes} <= set(BUCKETS.boundaries)  # as many compiled steps as buckets used
        losses[devices] = out
    np.testing.assert_allclose(losses[8], losses[1], rtol=2e-6)


def bag_of_tokens_loss(params, model_state, batch, rng):
    import jax.numpy as jnp

    tokens = batch["tokens"]
    present = (tokens != PAD).astype(jnp.float32)
    emb = params["emb"][jnp.clip(tokens, 0, None)] * present[..., None]
    mean = emb.sum(1) / jnp.maximum(present.sum(1), 1.0)[:, None]
    logits = mean @ params["w"]
    return jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch["mask"]), (
        model_state,
        {},
    )


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("source", "buckets", "error", "match"),
    [
        (
            "arrays",
            {"length": "n"},
            ValueError,
            r"`Buckets\(length='n'\)` names no field of the source; its fields are \['labels', 'length', 'tokens', "
            r"'y'\]",
        ),
        ("records", {"length": "n"}, ValueError, r"`Buckets\(length='n'\)` names no field of example 0"),
        ("records", {"length": lambda e: 1.5}, ValueError, r"The length of example 0 must be an int, got array\(1.5\)"),
        (
            "arrays",
            {"pad": {"tokenz": 0}},
            ValueError,
            r"`Buckets.pad` names field 'tokenz', but the source's fields are",
        ),
        (
            "arrays",
            {"pad": {"y": 0}},
            ValueError,
            r"Field 'y' of the source has shape \(150,\): a padded field needs a sequence axis",
        ),
        (
            "arrays",
            {"pad": {"tokens": 0.5}},
            ValueError,
            r"`pad\['tokens'\]=0.5` does not fit field 'tokens''s dtype int32",
        ),
        (
            "arrays",
            {"boundaries": (8, 16)},
            ValueError,
            r"Example \d+ has length \d+, above the last bucket boundary 16",
        ),
        (
            "short-arrays",
            {},
            ValueError,
            r"Field 'tokens' of the source has shape \(150, 20\).*at least the longest length, \d+ \(example \d+\)",
        ),
    ],
    ids=[
        "no-length-field",
        "no-length-in-record",
        "float-length",
        "no-pad-field",
        "pad-no-sequence-axis",
        "pad-value-dtype",
        "too-long",
        "field-too-short",
    ],
)
def test_bad_buckets_for_the_source_are_refused_when_the_loader_is_built(source, buckets, error, match):
    data = sst_like()
    src = {"arrays": data, "records": Records(data), "short-arrays": {**data, "tokens": data["tokens"][:, :20]}}[source]
    b = Buckets(**{"boundaries": (8, 16, 32, 64), "length": "length", "pad": {"tokens": 0}, **buckets})
    with pytest.raises(error, match=match):
        jddp.data.DataLoader(src, global_batch_size=8, buckets=b)


def test_a_record_shorter_than_its_length_is_refused_naming_it():
    data = sst_like()
    lying = Buckets(boundaries=(64,), length=lambda e: len(e["tokens"]) + 1, pad={"tokens": 0})
    loader = jddp.data.DataLoader(Records(data), global_batch_size=8, buckets=lying, shuffle=False, prefetch=0)
    with pytest.raises(
        ValueError, match=r"Field 'tokens' of example 0 has shape \(\d+,\), but the example's length is \d+"
    ) as info:
        next(iter(loader))
    assert any("padding examples [0, 1, 2" in note for note in info.value.__notes__)
    assert loader.get_state()["position"] == 0


def test_buckets_of_another_type_are_refused():
    with pytest.raises(TypeError, match=r"`buckets` must be a jddp.data.Buckets.*got buckets=\(8, 16\)"):
        jddp.data.DataLoader(sst_like(), global_batch_size=8, buckets=(8, 16))  # pyright: ignore[reportArgumentType]


def test_a_state_of_another_bucketing_is_refused_before_moving():
    data = sst_like()
    plain = jddp.data.DataLoader(data, global_batch_size=8)
    bucketed = jddp.data.DataLoader(data, global_batch_size=8, buckets=BUCKETS)
    other = jddp.data.DataLoader({**data, "length": data["length"][::-1].copy()}, global_batch_size=8, buckets=BUCKETS)
    with pytest.raises(ValueError, match="saved by a loader without buckets"):
        bucketed.set_state({**plain.get_state(), "position": 3})
    with pytest.raises(ValueError, match="saved by a loader with buckets"):
        plain.set_state({**bucketed.get_state(), "position": 3})
    with pytest.raises(ValueError, match="lengths: saved"):
        bucketed.set_state({**other.get_state(), "position": 3})
    assert plain.get_state()["position"] == bucketed.get_state()["position"] == 0
