"""DistributedBatchSampler: the whole global batch against a NumPy recomputation, the default seed, and the exact
wording of every refusal (argument, value and fix)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jddp.data.sampler import DistributedBatchSampler


def reference_global_batch(setup: dict, position: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indices, mask, places)`` of the global batch at ``position``, from the module's definitions alone."""
    n, batch = setup["dataset_size"], setup["global_batch_size"]
    per_epoch = n // batch if setup["drop_last"] else -(-n // batch)
    epoch, b = divmod(position, per_epoch)
    order = np.random.default_rng([setup["seed"], epoch]).permutation(n) if setup["shuffle"] else np.arange(n)
    places = [b * batch + i for i in range(batch)]
    mask = np.array([1.0 if p < n else 0.0 for p in places], np.float32)
    places = np.array([p % n for p in places], np.int64)  # padding re-reads valid entries
    return order[places], mask, places


@st.composite
def setups(draw):
    replicas = draw(st.integers(1, 6))
    batch = replicas * draw(st.integers(1, 5))
    drop_last = draw(st.booleans())
    size = draw(st.integers(batch if drop_last else 1, 90))
    setup = {
        "dataset_size": size,
        "global_batch_size": batch,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "drop_last": drop_last,
    }
    return setup, replicas


@settings(max_examples=50, deadline=None, derandomize=True)
@given(setups(), st.integers(0, 60))
def test_global_batch_is_the_definition_and_the_union_of_the_replica_slices(case, position):
    """``global_batch(p)`` is entries ``[b*B, (b+1)*B)`` of the epoch's order (padding masked) and equals every
    replica's ``local_batch(p)`` put side by side, on any replica count."""
    setup, replicas = case
    got = DistributedBatchSampler(**setup, num_replicas=replicas, rank=replicas - 1).global_batch(position)
    want = reference_global_batch(setup, position)
    assert isinstance(got, tuple) and len(got) == 3
    for a, b in zip(got, want, strict=True):
        assert a.shape == (setup["global_batch_size"],)
        np.testing.assert_array_equal(a, b)
    slices = [
        DistributedBatchSampler(**setup, num_replicas=replicas, rank=r).local_batch(position) for r in range(replicas)
    ]
    np.testing.assert_array_equal(got[0], np.concatenate([s.indices for s in slices]))
    np.testing.assert_array_equal(got[1], np.concatenate([s.mask for s in slices]))
    np.testing.assert_array_equal(got[2], np.concatenate([s.order for s in slices]))


def test_global_batch_of_a_padded_last_batch():
    """The last batch of 10 examples in batches of 4: two real entries, then two masked ones re-reading 0 and 1."""
    s = DistributedBatchSampler(10, global_batch_size=4, num_replicas=2, rank=1, shuffle=False, drop_last=False)
    indices, mask, places = s.global_batch(2)
    assert indices.tolist() == [8, 9, 0, 1]
    assert mask.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert places.tolist() == [8, 9, 0, 1]
    indices, mask, places = s.global_batch(4)  # epoch 1, batch 1
    assert indices.tolist() == [4, 5, 6, 7] and mask.tolist() == [1.0] * 4


@pytest.mark.parametrize("drop_last", [True, False], ids=["drop", "pad"])
def test_the_default_seed_is_0(drop_last):
    """Without ``seed`` the orders are those of seed 0: ``default_rng([0, epoch])``."""
    default = DistributedBatchSampler(30, global_batch_size=5, drop_last=drop_last)
    assert default.seed == 0 and default.state_dict()["seed"] == 0
    for epoch in range(3):
        np.testing.assert_array_equal(default.order(epoch), np.random.default_rng([0, epoch]).permutation(30))
    default.position = 8
    explicit = DistributedBatchSampler(30, global_batch_size=5, seed=0, drop_last=drop_last)
    explicit.load_state_dict(default.state_dict())  # a state saved without a seed resumes under seed=0
    assert explicit.position == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"dataset_size": 0, "global_batch_size": 4},
            "`dataset_size` must be an int >= 1, got dataset_size=0. The dataset is empty; give it at least one "
            "example.",
        ),
        (
            {"dataset_size": 10, "global_batch_size": 0},
            "`global_batch_size` must be an int >= 1, got global_batch_size=0. Use a positive batch size.",
        ),
        (
            {"dataset_size": 10, "global_batch_size": 4, "num_replicas": 0},
            "`num_replicas` must be an int >= 1, got num_replicas=0. Use at least one replica.",
        ),
        (
            {"dataset_size": 10, "global_batch_size": 4, "seed": -1},
            "`seed` must be an int >= 0, got seed=-1. Use a non-negative seed.",
        ),
        (
            {"dataset_size": 3, "global_batch_size": 4},
            "The dataset is smaller than one global batch with `drop_last=True`: dataset_size=3, global_batch_size=4, "
            "so an epoch has no batch. Use a smaller batch or drop_last=False (the batch is then padded with masked "
            "entries).",
        ),
    ],
    ids=["empty", "zero-batch", "zero-replicas", "negative-seed", "smaller-than-batch"],
)
def test_refusals_name_the_argument_its_value_and_the_fix(kwargs, message):
    """Each refusal is one sentence naming the argument and its value, then the fix as its own sentence."""
    with pytest.raises(ValueError) as info:
        DistributedBatchSampler(**kwargs)
    assert str(info.value) == message


def test_a_negative_epoch_is_refused_and_changes_nothing():
    s = DistributedBatchSampler(20, global_batch_size=4)
    s.position = 7
    with pytest.raises(ValueError) as info:
        s.set_epoch(-1)
    assert str(info.value) == "`epoch` must be an int >= 0, got epoch=-1. Epochs count from 0."
    assert s.position == 7


def test_a_negative_saved_position_is_refused_and_changes_nothing():
    s = DistributedBatchSampler(20, global_batch_size=4)
    s.position = 3
    with pytest.raises(ValueError) as info:
        s.load_state_dict({**s.state_dict(), "position": -1})
    assert str(info.value) == "`position` must be an int >= 0, got position=-1. Positions count from 0."
    assert s.position == 3


def test_a_state_of_another_setup_lists_every_difference_and_the_fix():
    s = DistributedBatchSampler(20, global_batch_size=4, seed=1, shuffle=True)
    with pytest.raises(ValueError) as info:
        s.load_state_dict({**s.state_dict(), "seed": 2, "shuffle": False, "position": 9})
    assert str(info.value) == (
        "The sampler state belongs to another data setup (seed: saved 2, here 1; shuffle: saved False, here True). "
        "Restore it with the dataset and settings it was saved with, or start this data from scratch."
    )
    assert s.position == 0
