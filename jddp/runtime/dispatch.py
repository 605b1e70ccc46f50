"""Bounds the compiled programs in flight on simulated CPU devices.

Two facts measured on XLA:CPU with several devices in one process (see
``docs/jax_notes.md`` and
``tests/test_engine.py::test_many_steps_in_flight_do_not_deadlock``):

* two *different* programs with collectives dispatched back to back without
  waiting can deadlock in the collective rendezvous, and XLA aborts the process
  after 40 s;
* even one program, dispatched asynchronously a few hundred times without
  waiting, deadlocks the same way (measured: 32 in flight passed, 128 aborted).

Every jddp program therefore goes through one process-wide ``Dispatcher``: it
waits for the oldest output once ``max_inflight`` calls are pending, and for all
of them before a different program starts. Waiting on a small output (the
metrics) costs one host sync and keeps ``max_inflight - 1`` steps of overlap
between Python and the devices.

In a group, a program's first call (``call`` with ``first=True``) compiles it, then meets every process
(``jddp.runtime.first_run``: bounded by the start-up timeout, ``JDDP_INIT_TIMEOUT``), and only then runs it, so
that gloo's fixed 30-s connection window of a first collective opens with every peer present.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import jax

from jddp.runtime import first_run, peer_wait, progress


class Dispatcher:
    """Tracks pending outputs of compiled programs; see the module docstring."""

    def __init__(self) -> None:
        self._pending: collections.deque[tuple[Any, str]] = collections.deque()
        self._program: object | None = None
        self.ahead = 2  # the largest max_inflight asked for so far: outputs not yet known complete
        # The programs called before (a first call compiles, and in a group meets), held weakly: an id could be
        # reused by another program after a collection, on one process and not another, and every process must
        # agree on which call is a first one.
        self._ran: weakref.WeakSet = weakref.WeakSet()

    def before(self, program: object, max_inflight: int) -> None:
        """Waits as needed before ``program`` is dispatched."""
        self.ahead = max(self.ahead, max_inflight)
        if program is not self._program:
            self.drain()
            self._program = program
        while len(self._pending) >= max_inflight:
            self._wait_oldest()

    def first_call(self, program: object) -> bool:
        """True the first time ``program`` is called (its call compiles it), then False."""
        if program in self._ran:
            return False
        self._ran.add(program)
        return True

    def call(self, program: Any, args: tuple, *, first: bool, label: str) -> Any:
        """``program(*args)``; on its ``first`` call in a group, compiled (``program.lower(*args).compile()``, which
        the call then finds in JAX's cache: neither traced nor compiled again) and every process met before it runs.

        Raises:
          first_run.StartupTimeoutError: a process did not reach the meeting within the start-up timeout.
          TimeoutError: gloo's own 30-s window ran out in the run (``first_run.explained``).
        """
        if first and first_run.needed():
            lower = getattr(program, "lower", None)
            if lower is not None:
                lower(*args).compile()
            first_run.meet(label)
        with first_run.explained(label):
            return program(*args)

    def after(self, outputs: Any, label: str = "program") -> None:
        """Records ``outputs`` (never donated later) of the call just dispatched, named ``label`` in flight
        records."""
        self._pending.append((outputs, label))

    def drain(self) -> None:
        """Waits for every pending output."""
        while self._pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        outputs, label = self._pending[0]
        with peer_wait.waiting(), first_run.explained(label):
            jax.block_until_ready(outputs)
        self._pending.popleft()
        p = progress.PROGRESS
        p.programs += 1
        p.last_done = label

    def unfinished(self) -> int:
        """The calls dispatched and not known complete: from the oldest pending one whose outputs are not all ready
        (the devices finish a program's calls in order), without waiting."""
        pending = list(self._pending)
        for i, (outputs, _) in enumerate(pending):
            if not all(x.is_ready() for x in jax.tree.leaves(outputs) if hasattr(x, "is_ready")):
                return len(pending) - i
        return 0

    def in_flight(self) -> list[str]:
        """The labels of the programs dispatched and not yet waited for (another thread may call it: ``list`` of a
        deque copies it in one step under the GIL)."""
        return [label for _, label in list(self._pending)]


DISPATCHER = Dispatcher()
