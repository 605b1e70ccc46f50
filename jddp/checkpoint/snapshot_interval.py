"""The snapshot interval: what an in-memory snapshot costs, measured two ways, and the steps between snapshots
that keep that cost within its budget of the step time (``jddp.checkpoint.snapshot`` takes them).

``Snapshots.proposal`` (``Interval.proposal``) is the number of steps between snapshots that keeps the measured time
within ``budget`` of the step time; the processes agree on the largest proposal at their preemption exchanges
(``jddp.checkpoint.preemption``), so that they all take snapshots at the same steps. A snapshot's cost is the larger
of two measures: the time it takes of the main and writer threads, and what it adds to the wall time of the
``AFTER`` steps that follow it, over the time of steps further from any snapshot (``Snapshots.note_step``). The
second is what the run pays: the copy program and the writer also take cores that the step's own threads, or another
process of the host, would use (the MNIST-1D MLP under ``jddp launch -n 2`` on 2 cores: 2.5 to 3.9 ms by the first,
6.7 to 9.2 ms by the second; ``benchmarks/snapshot_cost.py --within``). The main thread runs steps ahead of the
devices (``max_inflight``), so the steps its clock sees slowed come up to 5 after the snapshot: ``AFTER`` is 6 (over
3 steps the second measure saw a quarter of the cost, and the snapshots took 2.3% of the step time at a budget of
1%). A step's time disturbed by a disk save (``disturbed``) counts in neither.
"""

from __future__ import annotations

import math
import time

MAX_INTERVAL = 10_000
AFTER = 6  # the steps after a snapshot whose wall time counts toward its cost (its copy and write overlap them)


class Interval:
    """The cost model of one process's snapshots (``Snapshots`` is one): fed each step's time (``note_step``) and
    each snapshot's thread time (``_measured``), it proposes the steps between snapshots (``proposal``)."""

    def __init__(self, *, budget: float, every: int | None) -> None:
        self.budget = budget
        self.every = every
        self._first = True
        self._cost_s: float | None = None  # per snapshot: main thread + writer thread + waiting for it
        self._wall_cost_s: float | None = None  # per snapshot: the wall time it adds to the steps after it
        self._step_s: float | None = None  # wall time per step, between calls of `note_step`
        self._clean_s: float | None = None  # the same, of steps more than AFTER steps from a snapshot
        self._last_call: tuple[int, float] | None = None
        self._taken_at: int | None = None  # the step of the last snapshot
        self._added_s = 0.0  # the wall time the steps since it took beyond `_clean_s`, so far
        self._disturbed_until = -1  # steps up to this one are not measured (a disk save's)
        self._clock = time.perf_counter  # the steps' clock (a test's own)
        self.seconds = 0.0

    def note_step(self, step: int) -> None:
        """Called once per step, before the step's snapshot if any: the step time the interval is measured
        against, and the wall time the last snapshot added to the steps after it."""
        now = self._clock()
        last, self._last_call = self._last_call, (step, now)
        if last is None or step <= last[0]:
            return
        per_step = (now - last[1]) / (step - last[0])
        self._step_s = per_step if self._step_s is None else 0.8 * self._step_s + 0.2 * per_step
        since = step - self._taken_at if self._taken_at is not None else None
        if step <= self._disturbed_until or step - last[0] > 1:
            if since is not None and since <= AFTER:
                self._taken_at = None  # this snapshot's steps are not all measured: no wall cost from it
            return
        if since is None or since > AFTER:
            self._clean_s = per_step if self._clean_s is None else 0.8 * self._clean_s + 0.2 * per_step
        elif self._clean_s is not None:
            self._added_s += per_step - self._clean_s
            if since == AFTER:
                added = max(self._added_s, 0.0)
                self._wall_cost_s = added if self._wall_cost_s is None else 0.8 * self._wall_cost_s + 0.2 * added

    def disturbed(self, step: int) -> None:
        """The steps through ``step + AFTER`` also carry other work (a disk save at ``step``): not measured."""
        self._disturbed_until = step + AFTER

    def proposal(self) -> int:
        """The steps between snapshots that keep their measured cost within ``budget`` of the step time (or the
        fixed ``every``)."""
        if self.every is not None:
            return self.every
        if self._cost_s is None or not self._step_s:
            return 1
        cost = max(self._cost_s, self._wall_cost_s or 0.0)
        return int(min(max(math.ceil(cost / (self.budget * self._step_s)), 1), MAX_INTERVAL))

    def _measured(self, seconds: float) -> None:
        self.seconds += seconds
        if self._first:  # the first one compiles the copy program: not what the next ones cost
            self._first = False
            return
        self._cost_s = seconds if self._cost_s is None else 0.8 * self._cost_s + 0.2 * seconds

    def _started(self, step: int) -> None:
        """A snapshot taken at ``step``: its wall cost is measured over the next AFTER steps (not the first's: it
        compiles the copy program)."""
        self._taken_at, self._added_s = (None if self._first else step), 0.0
