"""DistributedBatchSampler: world-size invariance, coverage and resume, as properties."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jddp.data.sampler import DistributedBatchSampler


@st.composite
def setups(draw):
    replicas = draw(st.integers(1, 8))
    per_replica = draw(st.integers(1, 6))
    batch = replicas * per_replica
    drop_last = draw(st.booleans())
    size = draw(st.integers(batch if drop_last else 1, 120))
    return {
        "dataset_size": size,
        "global_batch_size": batch,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "drop_last": drop_last,
    }, replicas


def global_batches(setup: dict, replicas: int, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global batches of ``epoch``, assembled from every replica's slices."""
    samplers = [DistributedBatchSampler(**setup, num_replicas=replicas, rank=r) for r in range(replicas)]
    out = []
    for s in samplers:
        s.set_epoch(epoch)
    for slices in zip(*samplers, strict=True):
        out.append((np.concatenate([b.indices for b in slices]), np.concatenate([b.mask for b in slices])))
    return out


@settings(max_examples=60, deadline=None)
@given(setups(), st.integers(1, 8))
def test_global_batches_do_not_depend_on_replicas(case, other_replicas):
    setup, replicas = case
    if setup["global_batch_size"] % other_replicas:
        other_replicas = 1
    a = global_batches(setup, replicas, epoch=0)
    b = global_batches(setup, other_replicas, epoch=0)
    assert len(a) == len(b)
    for (ia, ma), (ib, mb) in zip(a, b, strict=True):
        np.testing.assert_array_equal(ia, ib)
        np.testing.assert_array_equal(ma, mb)


@settings(max_examples=60, deadline=None)
@given(setups())
def test_slices_disjoint_and_epoch_covers_each_example_once(case):
    setup, replicas = case
    samplers = [DistributedBatchSampler(**setup, num_replicas=replicas, rank=r) for r in range(replicas)]
    seen = []
    for slices in zip(*samplers, strict=True):
        real = [b.indices[b.mask == 1] for b in slices]
        flat = np.concatenate(real)
        assert len(np.unique(flat)) == len(flat)  # disjoint within the global batch
        seen.append(flat)
        assert all(len(b.indices) == setup["global_batch_size"] // replicas for b in slices)
    seen = np.concatenate(seen)
    n, batch = setup["dataset_size"], setup["global_batch_size"]
    assert len(np.unique(seen)) == len(seen)  # never twice in an epoch
    expected = (n // batch) * batch if setup["drop_last"] else n
    assert len(seen) == expected
    if not setup["drop_last"]:
        np.testing.assert_array_equal(np.sort(seen), np.arange(n))


@settings(max_examples=40, deadline=None)
@given(setups())
def test_epochs_differ_and_seed_repeats(case):
    setup, replicas = case
    e0 = global_batches(setup, replicas, 0)
    e1 = global_batches(setup, replicas, 1)
    again = global_batches(setup, replicas, 0)
    for (a, _), (b, _) in zip(e0, again, strict=True):
        np.testing.assert_array_equal(a, b)
    order0 = np.concatenate([i for i, _ in e0])
    order1 = np.concatenate([i for i, _ in e1])
    if setup["shuffle"] and setup["dataset_size"] >= 8:
        # Two independent permutations of >= 8 items agree with probability <= 1/8! per seed.
        assert not np.array_equal(order0, order1)
    elif not setup["shuffle"]:
        np.testing.assert_array_equal(order0, order1)


@pytest.mark.parametrize(
    ("size", "drop_last", "expected"),
    [(12, False, 3), (12, True, 3), (13, False, 4), (13, True, 3), (3, False, 1), (4, True, 1)],
    ids=["divides", "divides-drop", "remainder", "remainder-drop", "smaller-than-a-batch", "one-batch-drop"],
)
def test_len_counts_the_batches_of_an_epoch(size, drop_last, expected):
    s = DistributedBatchSampler(size, global_batch_size=4, num_replicas=2, rank=1, drop_last=drop_last)
    assert len(s) == expected
    assert len(list(s)) == expected


@settings(max_examples=60, deadline=None)
@given(setups(), st.integers(1, 6), st.booleans())
def test_len_is_the_batches_of_an_epoch_and_none_is_all_padding(case, batches, divides):
    """``len`` counts the global batches; no batch is padding only, whether the size divides or not."""
    setup, replicas = case
    batch = setup["global_batch_size"]
    if divides:
        setup = {**setup, "dataset_size": batches * batch}
    n = setup["dataset_size"]
    expected = n // batch if setup["drop_last"] else -(-n // batch)
    samplers = [DistributedBatchSampler(**setup, num_replicas=replicas, rank=r) for r in range(replicas)]
    assert all(len(s) == expected for s in samplers)
    epoch = list(zip(*samplers, strict=True))
    assert len(epoch) == expected and all(s.epoch == 1 for s in samplers)
    for slices in epoch:
        assert sum(float(b.mask.sum()) for b in slices) > 0, "a global batch of padding only"


def test_forgetting_set_epoch_does_not_repeat_the_order():
    s = DistributedBatchSampler(50, global_batch_size=10, seed=3)
    first = np.concatenate([b.indices for b in s])
    second = np.concatenate([b.indices for b in s])  # no set_epoch in between
    assert s.epoch == 2
    assert not np.array_equal(first, second)
    s.set_epoch(0)
    np.testing.assert_array_equal(np.concatenate([b.indices for b in s]), first)


@settings(max_examples=40, deadline=None)
@given(setups(), st.integers(1, 8), st.integers(0, 30), st.data())
def test_resume_on_any_replica_count_continues_the_sequence(case, new_replicas, stop, data):
    setup, replicas = case
    if setup["global_batch_size"] % new_replicas:
        new_replicas = replicas
    reference = DistributedBatchSampler(**setup)  # one replica: the whole global batches
    total = 3 * len(reference)
    stop = min(stop, total)
    expected = [reference.local_batch(p).indices for p in range(stop, total)]

    old = [DistributedBatchSampler(**setup, num_replicas=replicas, rank=r) for r in range(replicas)]
    for s in old:
        s.position = stop
    state = json.loads(json.dumps(old[data.draw(st.integers(0, replicas - 1))].state_dict()))
    new = [DistributedBatchSampler(**setup, num_replicas=new_replicas, rank=r) for r in range(new_replicas)]
    for s in new:
        s.load_state_dict(state)
    got = []
    while new[0].position < total:
        got.append(np.concatenate([next(iter(s)).indices for s in new]))
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=40, deadline=None)
@given(setups(), st.integers(0, 40), st.data())
def test_local_block_equals_the_definition(case, position, data):
    setup, replicas = case
    rank = data.draw(st.integers(0, replicas - 1))
    s = DistributedBatchSampler(**setup, num_replicas=replicas, rank=rank)
    per_epoch = len(s)
    count = data.draw(st.integers(1, per_epoch - position % per_epoch))
    indices, mask, places = s.local_block(position, count)
    n, batch = setup["dataset_size"], setup["global_batch_size"]
    epoch, first = divmod(position, per_epoch)
    order = np.random.default_rng([setup["seed"], epoch]).permutation(n) if setup["shuffle"] else np.arange(n)
    width = batch // replicas
    for j in range(count):
        want = np.arange((first + j) * batch, (first + j + 1) * batch)[rank * width : (rank + 1) * width]
        np.testing.assert_array_equal(mask[j], (want < n).astype(np.float32))
        np.testing.assert_array_equal(places[j], want % n)
        np.testing.assert_array_equal(indices[j], order[want % n])
        np.testing.assert_array_equal(indices[j], s.local_batch(position + j).indices)


# ------------------------------------------------------------------ padded_batch_size (DataLoader's max_per_device)


@st.composite
def padded_setups(draw):
    """A setup whose batch the replicas need not divide, and a padded size ``P >= B`` that they do."""
    batch = draw(st.integers(1, 12))
    drop_last = draw(st.booleans())
    setup = {
        "dataset_size": draw(st.integers(batch if drop_last else 1, 60)),
        "global_batch_size": batch,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "drop_last": drop_last,
    }
    replicas = draw(st.integers(1, 6))
    padded = replicas * draw(st.integers(-(-batch // replicas), -(-batch // replicas) + 3))
    return setup, replicas, padded


def padded_slices(setup: dict, replicas: int, padded: int, position: int) -> list:
    return [
        DistributedBatchSampler(**setup, num_replicas=replicas, rank=r, padded_batch_size=padded).local_batch(position)
        for r in range(replicas)
    ]


@settings(max_examples=80, deadline=None)
@given(padded_setups(), st.integers(0, 30))
def test_padding_keeps_each_real_example_in_its_slot_on_any_replica_count(case, position):
    setup, replicas, padded = case
    plain = DistributedBatchSampler(**setup).local_batch(position)  # one replica, P = B
    slices = padded_slices(setup, replicas, padded, position)
    assert all(len(b.indices) == padded // replicas for b in slices)
    indices, mask = np.concatenate([b.indices for b in slices]), np.concatenate([b.mask for b in slices])
    batch = setup["global_batch_size"]
    assert not mask[batch:].any()  # the slots past B are padding
    # Slot = place: the real entries are P = B's, in the same slots, and the real examples are disjoint.
    np.testing.assert_array_equal(mask[:batch], plain.mask)
    np.testing.assert_array_equal(indices[:batch][plain.mask == 1], plain.indices[plain.mask == 1])
    real = indices[mask == 1]
    assert len(np.unique(real)) == len(real)
    assert np.all((indices >= 0) & (indices < setup["dataset_size"]))  # padding re-reads valid indices
    sampler = DistributedBatchSampler(**setup, num_replicas=replicas, padded_batch_size=padded)
    np.testing.assert_array_equal(sampler.global_batch(position)[0], indices)
    np.testing.assert_array_equal(sampler.examples_at(position), plain.indices[plain.mask == 1])


@settings(max_examples=40, deadline=None)
@given(padded_setups(), padded_setups(), st.integers(0, 30))
def test_a_state_saved_on_any_replicas_and_padding_resumes_on_any_other(case, other, stop):
    setup, replicas, padded = case
    _, new_replicas, new_padded = other
    new_padded = max(new_padded, new_replicas * -(-setup["global_batch_size"] // new_replicas))
    old = DistributedBatchSampler(**setup, num_replicas=replicas, rank=replicas - 1, padded_batch_size=padded)
    old.position = stop
    state = json.loads(json.dumps(old.state_dict()))
    assert "padded_batch_size" not in state  # the state is the same as without padding
    assert state == {**DistributedBatchSampler(**setup).state_dict(), "position": stop, "epoch": old.epoch}
    new = DistributedBatchSampler(**setup, num_replicas=new_replicas, rank=0, padded_batch_size=new_padded)
    new.load_state_dict(state)
    assert new.position == stop
    for position in (stop, stop + 1):
        got = padded_slices(setup, new_replicas, new_padded, position)
        mask = np.concatenate([b.mask for b in got])
        want = DistributedBatchSampler(**setup).local_batch(position)
        np.testing.assert_array_equal(np.concatenate([b.indices for b in got])[mask == 1], want.indices[want.mask == 1])


def test_local_block_must_stay_inside_one_epoch():
    s = DistributedBatchSampler(100, global_batch_size=10)
    with pytest.raises(ValueError, match=r"inside one epoch of 10 batches, got position=17, count=4"):
        s.local_block(17, 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset_size": 0, "global_batch_size": 4}, r"dataset_size=0. The dataset is empty"),
        ({"dataset_size": 10, "global_batch_size": 6, "num_replicas": 4}, r"global_batch_size=6, num_replicas=4"),
        ({"dataset_size": 3, "global_batch_size": 4}, r"dataset_size=3, global_batch_size=4.*drop_last=False"),
        ({"dataset_size": 10, "global_batch_size": 4, "num_replicas": 2, "rank": 2}, r"rank=2, num_replicas=2"),
        ({"dataset_size": 10, "global_batch_size": 0}, r"global_batch_size=0"),
        (
            {"dataset_size": 10, "global_batch_size": 6, "padded_batch_size": 5},
            r"`padded_batch_size` must be an int >= 6, got padded_batch_size=5. It is the global batch's 6 entries",
        ),
        (
            {"dataset_size": 10, "global_batch_size": 6, "num_replicas": 4, "padded_batch_size": 7},
            r"`padded_batch_size` must be divisible by `num_replicas` .* padded_batch_size=7, num_replicas=4",
        ),
    ],
    ids=["empty", "indivisible", "smaller-than-batch", "rank", "zero-batch", "padded-small", "padded-indivisible"],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedBatchSampler(**kwargs)


def test_state_from_another_dataset_is_refused():
    s = DistributedBatchSampler(100, global_batch_size=10, seed=1)
    with pytest.raises(ValueError, match=r"dataset_size: saved 90, here 100"):
        s.load_state_dict({**s.state_dict(), "dataset_size": 90})
    with pytest.raises(ValueError, match=r"seed: saved 2, here 1"):
        s.load_state_dict({**s.state_dict(), "seed": 2})
    with pytest.raises(ValueError, match=r"lacks keys \['position'"):
        s.load_state_dict({"seed": 1})
    with pytest.raises(TypeError, match=r"`state` must be the dict that `state_dict\(\)` .* returned, got int"):
        s.load_state_dict(3)  # was Python's "argument of type 'int' is not iterable"
    assert s.position == 0  # nothing changed
