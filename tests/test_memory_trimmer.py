"""The heap trimmer's schedule (``jddp.runtime.memory.Trimmer``) in this process, against a recorded
``malloc_trim``: it calls ``malloc_trim(0)``, at most once every ``every`` seconds, on the clock it is given.
(``tests/test_leaks.py`` measures the pages returned, in a process of its own.)"""

from __future__ import annotations

import pytest

from jddp.runtime import memory


@pytest.mark.parametrize("every", [0.5, 60.0, 600.0])
def test_the_trimmer_calls_malloc_trim_at_most_once_every_interval(monkeypatch, every):
    calls: list[int] = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: lambda pad: calls.append(pad) or 1)
    # Generated times: steps at a tenth of the interval, over ten intervals.
    times = [0.0] + [every * i / 10 for i in range(1, 101)]
    clock = iter([0.0, *(t for t in times for _ in (0, 1))]).__next__  # each maybe() reads the clock, a trim twice
    trimmer = memory.Trimmer(every=every, clock=clock)
    trimmed = []
    for _ in times:
        did = trimmer.maybe()
        if not did:
            clock()  # keep the two reads per call in step
        trimmed.append(did)
    expected, last = [], 0.0
    for t in times:  # the rule, written out: due when `every` has passed since the last trim (or the start)
        due = t - last >= every
        expected.append(due)
        last = t if due else last
    assert trimmed == expected
    assert calls == [0] * sum(expected) and trimmer.trims == sum(expected)


def test_without_malloc_trim_the_trimmer_does_nothing(monkeypatch):
    monkeypatch.setattr(memory, "_malloc_trim", lambda: None)
    trimmer = memory.Trimmer(every=0.0, clock=iter([0.0, 5.0]).__next__)
    assert trimmer.maybe() is False and trimmer.trims == 0
