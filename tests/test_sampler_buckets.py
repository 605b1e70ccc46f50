"""BucketedBatchSampler: one bucket per global batch, world-size invariant, each example once, resumable.

The cases are drawn (hypothesis) from the sampler's parameters: lengths, boundaries, batch size, replicas,
padded size, seed, shuffle and drop_last. The batch order is checked against an independent reference: a plain
Python walk of the epoch's order that fills one list per bucket and emits a list when it holds a batch
(``tf.data``'s ``bucket_by_sequence_length``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jddp.data.buckets import BucketedBatchSampler, Buckets
from jddp.data.sampler import DistributedBatchSampler


@st.composite
def setups(draw):
    """``(lengths, buckets, sampler kwargs, replicas)``: replicas divide the padded size."""
    boundaries = tuple(sorted(draw(st.sets(st.integers(1, 40), min_size=1, max_size=4))))
    n = draw(st.integers(1, 90))
    lengths = np.array(draw(st.lists(st.integers(0, boundaries[-1]), min_size=n, max_size=n)), np.int64)
    batch = draw(st.integers(1, 12))
    replicas = draw(st.integers(1, 4))
    padded = replicas * draw(st.integers(-(-batch // replicas), -(-batch // replicas) + 2))
    drop_last = draw(st.booleans())
    counts = np.bincount(np.searchsorted(boundaries, lengths), minlength=len(boundaries))
    if drop_last and counts.max() < batch:
        drop_last = False
    kwargs = {
        "global_batch_size": batch,
        "padded_batch_size": padded,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
        "drop_last": drop_last,
    }
    return lengths, Buckets(boundaries=boundaries, length="n", pad={"t": 0}), kwargs, replicas


def assembled(lengths, buckets, kwargs, replicas, epoch):
    """Epoch ``epoch``'s global batches as ``replicas`` readers see them, each ``(indices, mask)`` of the real
    slots (the first ``global_batch_size``) and the boundaries each replica was told."""
    samplers = [
        BucketedBatchSampler(lengths, buckets, **kwargs, num_replicas=replicas, rank=r) for r in range(replicas)
    ]
    for s in samplers:
        s.set_epoch(epoch)
    out = []
    for slices in zip(*samplers, strict=True):
        indices = np.concatenate([b.indices for b in slices])[: kwargs["global_batch_size"]]
        mask = np.concatenate([b.mask for b in slices])
        assert not mask[kwargs["global_batch_size"] :].any()  # slots past B are padding
        boundary = {s.boundary_at(slices[0].position) for s in samplers}
        assert len(boundary) == 1  # every replica is told the same shape
        out.append((indices, mask[: kwargs["global_batch_size"]], boundary.pop()))
    return out


def reference(lengths, boundaries, order, batch, drop_last):
    """tf.data's bucket_by_sequence_length on ``order``: a batch leaves its bucket when full; rests at the end."""
    pending = {k: [] for k in range(len(boundaries))}
    out = []
    for i in order.tolist():
        k = next(j for j, b in enumerate(boundaries) if lengths[i] <= b)
        pending[k].append(i)
        if len(pending[k]) == batch:
            out.append((pending[k], boundaries[k]))
            pending[k] = []
    if not drop_last:
        out.extend((rest, boundaries[k]) for k, rest in pending.items() if rest)
    return out


@settings(max_examples=80, deadline=None)
@given(setups(), st.integers(1, 4), st.integers(0, 2))
def test_global_batches_do_not_depend_on_replicas_or_padding(case, other, epoch):
    lengths, buckets, kwargs, replicas = case
    plain = {**kwargs, "padded_batch_size": None}
    a = assembled(lengths, buckets, kwargs, replicas, epoch)
    b = assembled(lengths, buckets, plain, 1, epoch)
    if kwargs["global_batch_size"] % other == 0:
        b = assembled(lengths, buckets, {**plain, "padded_batch_size": None}, other, epoch)
    assert len(a) == len(b)
    for (ia, ma, ba), (ib, mb, bb) in zip(a, b, strict=True):
        np.testing.assert_array_equal(ma, mb)
        np.testing.assert_array_equal(ia[ma > 0], ib[mb > 0])
        assert ba == bb


@settings(max_examples=80, deadline=None)
@given(setups(), st.integers(0, 2))
def test_the_batches_are_tf_datas_bucketing_of_the_epochs_order(case, epoch):
    lengths, buckets, kwargs, replicas = case
    got = assembled(lengths, buckets, kwargs, replicas, epoch)
    n = len(lengths)
    order = DistributedBatchSampler(n, **{**kwargs, "drop_last": False}).order(epoch)
    want = reference(lengths, buckets.boundaries, order, kwargs["global_batch_size"], kwargs["drop_last"])
    assert [(ind[m > 0].tolist(), b) for ind, m, b in got] == want


@settings(max_examples=80, deadline=None)
@given(setups())
def test_one_bucket_per_batch_each_example_once_and_padding_masked(case):
    lengths, buckets, kwargs, replicas = case
    boundaries, batch = buckets.boundaries, kwargs["global_batch_size"]
    seen = []
    for indices, mask, boundary in assembled(lengths, buckets, kwargs, replicas, 0):
        k = boundaries.index(boundary)
        low = boundaries[k - 1] if k else -1
        # every entry read, padding too, is of the batch's bucket: the batch has one shape
        assert all(low < lengths[i] <= boundary for i in indices)
        real = indices[mask > 0]
        assert mask[: len(real)].all() and not mask[len(real) :].any()  # real entries first, then padding
        assert 0 < len(real) <= batch
        seen.append(real)
    seen = np.concatenate(seen)
    assert len(np.unique(seen)) == len(seen)  # never twice in an epoch
    counts = np.bincount(np.searchsorted(boundaries, lengths), minlength=len(boundaries))
    if kwargs["drop_last"]:  # exactly each bucket's whole batches
        assert len(seen) == int((counts // batch * batch).sum())
    else:
        np.testing.assert_array_equal(np.sort(seen), np.arange(len(lengths)))


@settings(max_examples=40, deadline=None)
@given(setups(), st.integers(1, 4), st.integers(0, 30), st.data())
def test_resume_on_any_replica_count_continues_the_sequence(case, new_replicas, stop, data):
    lengths, buckets, kwargs, replicas = case
    if kwargs["padded_batch_size"] % new_replicas:
        new_replicas = replicas
    one = BucketedBatchSampler(lengths, buckets, **kwargs)
    total = 3 * len(one)
    stop = min(stop, total)
    expected = [(one.global_batch(p)[0], one.boundary_at(p)) for p in range(stop, total)]
    old = BucketedBatchSampler(
        lengths, buckets, **kwargs, num_replicas=replicas, rank=data.draw(st.integers(0, 3)) % replicas
    )
    old.position = stop
    state = json.loads(json.dumps(old.state_dict()))
    new = [
        BucketedBatchSampler(lengths, buckets, **kwargs, num_replicas=new_replicas, rank=r) for r in range(new_replicas)
    ]
    for s in new:
        s.load_state_dict(state)
    got = []
    while new[0].position < total:
        got.append((np.concatenate([next(iter(s)).indices for s in new]), new[0].boundary_at(new[0].position - 1)))
    assert len(got) == len(expected)
    for (a, ba), (b, bb) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
        assert ba == bb


@settings(max_examples=40, deadline=None)
@given(setups())
def test_every_epoch_has_as_many_batches_and_a_new_order(case):
    lengths, buckets, kwargs, replicas = case
    epochs = [assembled(lengths, buckets, kwargs, replicas, e) for e in range(3)]
    assert len({len(e) for e in epochs}) == 1
    again = assembled(lengths, buckets, kwargs, replicas, 1)
    for (a, _, _), (b, _, _) in zip(epochs[1], again, strict=True):
        np.testing.assert_array_equal(a, b)  # the same seed and epoch give the same batches
    if kwargs["shuffle"] and len(lengths) >= 12:
        flat = [np.concatenate([i for i, _, _ in e]) for e in epochs[:2]]
        assert not np.array_equal(flat[0], flat[1])


def test_a_batch_spread_over_replicas_keeps_its_real_entries_in_the_first_slots():
    lengths = np.array([1, 1, 1, 5, 5], np.int64)
    b = Buckets(boundaries=(2, 8), length="n", pad={"t": 0})
    slices = [
        BucketedBatchSampler(lengths, b, global_batch_size=4, num_replicas=2, rank=r, shuffle=False, drop_last=False)
        for r in range(2)
    ]
    first = [s.local_batch(0) for s in slices]  # bucket 2: examples 0, 1, 2 and one padding entry
    assert [x.indices.tolist() for x in first] == [[0, 1], [2, 0]]
    assert [x.mask.tolist() for x in first] == [[1.0, 1.0], [1.0, 0.0]]
    assert [s.boundary_at(0) for s in slices] == [2, 2] and slices[0].boundary_at(1) == 8


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"boundaries": ()}, ValueError, r"`boundaries` must be a non-empty tuple"),
        ({"boundaries": (8, 8)}, ValueError, r"strictly increasing.*boundaries=\(8, 8\)"),
        ({"boundaries": (16, 8)}, ValueError, r"strictly increasing.*boundaries=\(16, 8\)"),
        ({"boundaries": (0, 8)}, ValueError, r"ints >= 1"),
        ({"boundaries": 8}, ValueError, r"boundaries=8"),
        ({"boundaries": (4.0, 8)}, ValueError, r"boundaries=\(4.0, 8\)"),
        ({"length": 3}, TypeError, r"`length` must be the name of a source field"),
        ({"length": ""}, TypeError, r"`length` must be the name"),
        ({"pad": {}}, ValueError, r"`pad` must map each field"),
        ({"pad": {"mask": 0}}, ValueError, r"not 'mask'"),
        ({"pad": {"t": "0"}}, TypeError, r"pad\['t'\]='0'"),
        ({"pad": {"t": True}}, TypeError, r"pad\['t'\]=True"),
        ({"pad": {"n": 0}}, ValueError, r"`length`='n' is a field of one int per example"),
        ({"too_long": "cut"}, ValueError, r"too_long='cut'"),
    ],
    ids=lambda v: str(v)[:40] if not isinstance(v, type) else v.__name__,
)
def test_bad_buckets_are_refused_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        Buckets(**{"boundaries": (8, 16), "length": "n", "pad": {"t": 0}, **kwargs})


def test_a_length_past_the_last_boundary_is_refused_naming_the_example_or_cut():
    b = Buckets(boundaries=(4, 8), length="n", pad={"t": 0})
    lengths = np.array([3, 9, 2, 12], np.int64)
    with pytest.raises(
        ValueError,
        match=r"Example 1 has length 9, above the last bucket boundary 8 \(and 1 more.*longest 12.*too_long='truncate'",
    ):
        BucketedBatchSampler(lengths, b, global_batch_size=2)
    cut = BucketedBatchSampler(
        lengths, Buckets(**{**vars(b), "too_long": "truncate"}), global_batch_size=2, shuffle=False
    )
    assert cut.lengths.tolist() == [3, 8, 2, 8]
    assert [cut.boundary_at(p) for p in range(len(cut))] == [4, 8]


@pytest.mark.parametrize(
    ("lengths", "match"),
    [
        ([1, -2], r"Example 1 has length -2: lengths must be >= 0"),
        ([[1, 2]], r"one int per example, got an array of shape \(1, 2\)"),
        ([1.5], r"dtype float64"),
    ],
    ids=["negative", "2-d", "float"],
)
def test_bad_lengths_are_refused(lengths, match):
    with pytest.raises(ValueError, match=match):
        BucketedBatchSampler(np.array(lengths), Buckets(boundaries=(4,), length="n", pad={"t": 0}), global_batch_size=1)


def test_drop_last_with_no_whole_batch_in_any_bucket_is_refused():
    b = Buckets(boundaries=(4, 8), length="n", pad={"t": 0})
    with pytest.raises(ValueError, match=r"No bucket holds a whole global batch of 3 .*\{4: 2, 8: 2\}"):
        BucketedBatchSampler(np.array([1, 2, 5, 6]), b, global_batch_size=3, drop_last=True)


def test_states_of_other_buckets_or_none_are_refused_before_moving():
    b = Buckets(boundaries=(4, 8), length="n", pad={"t": 0})
    lengths = np.array([1, 2, 5, 6, 7, 3], np.int64)
    s = BucketedBatchSampler(lengths, b, global_batch_size=2)
    plain = DistributedBatchSampler(6, global_batch_size=2)
    s.position = plain.position = 1
    cases = [
        (s, plain.state_dict(), r"saved by a loader without buckets"),
        (plain, {**s.state_dict(), "position": 2}, r"saved by a loader with buckets"),
        (
            s,
            BucketedBatchSampler(lengths[::-1].copy(), b, global_batch_size=2).state_dict(),
            r"lengths: saved '[0-9a-f]+', here",
        ),
        (
            s,
            BucketedBatchSampler(
                lengths, Buckets(boundaries=(5, 8), length="n", pad={"t": 0}), global_batch_size=2
            ).state_dict(),
            r"boundaries: saved \[5, 8\], here \[4, 8\]",
        ),
        (s, {**s.state_dict(), "buckets": "x"}, r"other buckets \(saved 'x'\)"),
    ]
    for target, state, match in cases:
        with pytest.raises(ValueError, match=match):
            target.load_state_dict(state)
        assert target.position == 1
