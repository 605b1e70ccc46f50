"""DistributedBatchSampler's skip record, for mutation testing: states that ``skip`` and ``state_dict`` write load
back whatever their shape (a range from 0, adjacent ranges, a range that ends at the position), other shapes of
``skipped`` are refused with the sampler's own error, and the refusals of ``skip`` and ``position_of_step`` word."""

from __future__ import annotations

import json
import re

import pytest

from jddp.data.sampler import DistributedBatchSampler


def sampler() -> DistributedBatchSampler:
    return DistributedBatchSampler(100, global_batch_size=10)


def test_back_to_back_skips_from_position_0_round_trip_through_a_saved_state():
    """Two skips in a row from the start give the ranges [0, 3) and [3, 5), the second ending at the position; the
    state, through JSON as a checkpoint holds it, loads into a new sampler with the same record and steps."""
    s = sampler()
    s.skip(3)
    s.skip(2)
    assert s.skipped == [(0, 3), (3, 5)] and s.position == 5
    again = sampler()
    again.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert again.skipped == [(0, 3), (3, 5)] and again.position == 5
    assert [again.position_of_step(step) for step in range(3)] == [5, 6, 7]


def test_a_skip_of_one_batch_is_allowed():
    s = sampler()
    s.position = 4
    s.skip(1)
    assert s.skipped == [(4, 5)] and s.position == 5 and s.position_of_step(4) == 5


@pytest.mark.parametrize(
    "skipped",
    [None, ((1, 2),), [[1, 2, 3]], [5], [[1, 2], None], [[True, 2]]],
    ids=["none", "tuple-of-ranges", "three-numbers", "a-number", "none-range", "bool-start"],
)
def test_a_skipped_entry_of_another_shape_is_refused_with_the_samplers_error(skipped):
    """Not a list of [start, stop) pairs of ints: a ValueError naming the entry, never a TypeError from inside, and
    the sampler unchanged."""
    s = sampler()
    state = {**s.state_dict(), "position": 20, "skipped": skipped}
    expected = (
        f"Sampler state has skipped={skipped!r}: it must be a list of increasing, disjoint [start, stop) position "
        "ranges before the position 20, as `state_dict()` writes it."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        s.load_state_dict(state)
    assert s.position == 0 and s.skipped == []


@pytest.mark.parametrize("bad", [0, -2, 1.5, True], ids=["zero", "negative", "float", "bool"])
def test_skip_refuses_a_count_below_one_saying_so(bad):
    with pytest.raises(ValueError) as error:
        sampler().skip(bad)
    assert str(error.value) == f"`batches` must be an int >= 1, got batches={bad!r}. Skip at least one batch."


@pytest.mark.parametrize("bad", [-1, 1.0, None], ids=["negative", "float", "none"])
def test_position_of_step_refuses_a_step_that_is_not_a_count_saying_so(bad):
    with pytest.raises(ValueError) as error:
        sampler().position_of_step(bad)
    assert str(error.value) == f"`step` must be an int >= 0, got step={bad!r}. Steps count from 0."
