"""Preemption: a SIGTERM seen by any process, agreed at one step by every process."""

from __future__ import annotations

import signal
import threading
import time

import jax
import numpy as np

from jddp.runtime import dispatch, first_run, watchdog


def all_agree(flag: bool) -> bool:
    """True only if ``flag`` is True on every process (a collective in a group)."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    first_run.meet_once(first_run.GLOBAL_DEVICES, "a Checkpointer's agreement")  # gloo's window opens with all
    with watchdog.waiting():
        flags = np.asarray(multihost_utils.process_allgather(np.asarray([flag], np.int32)))
    return bool(flags.min())


_SIGTERM = threading.Event()  # set by the handler below; process-wide, shared by every Checkpointer
_handler_users = 0


def _on_sigterm(signum, frame) -> None:
    _SIGTERM.set()


def _install_sigterm_handler() -> bool:
    """Routes SIGTERM to ``_SIGTERM`` while a Checkpointer is open; False where that is impossible.

    Installed over the default action and over a handler not set from Python
    (``signal.getsignal`` gives ``None``: JAX's preemption notifier, which would
    otherwise swallow the signal); a handler the program set itself is left alone.
    """
    global _handler_users
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        if current not in (signal.SIG_DFL, None):
            return False
        signal.signal(signal.SIGTERM, _on_sigterm)
    _handler_users += 1
    return True


def _uninstall_sigterm_handler() -> None:
    """When the last Checkpointer closes: the default action again (JAX's notifier cannot be put back).

    The notice is dropped with the handler: it was for the Checkpointers that
    were open, and a later one must not stop at its first step for it.
    """
    global _handler_users
    _handler_users -= 1
    if _handler_users == 0:
        _SIGTERM.clear()
        if signal.getsignal(signal.SIGTERM) is _on_sigterm and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Preemption:
    """A SIGTERM seen by any process, agreed at one step by all.

    Alone, a process stops at the first step after its signal. In a group, the
    processes exchange their notices with one all-gather at agreed steps (every
    ``check_s`` seconds of process 0's wall time, converted to steps and shared
    by the same all-gather), and all stop at the first of those steps after any
    notice. A notice is a SIGTERM caught here, or JAX's preemption sync point
    (for a signal that JAX caught before a Checkpointer was open). JAX's sync
    point alone is not enough: it is computed in the background from the steps
    the processes had reached, and a process that asks for that step before
    the answer arrives is told False and trains on while the others stop
    (measured under ``jddp launch``: the others exit, it waits forever in the
    next step's collective).
    """

    MAX_INTERVAL = 10_000

    def __init__(self, check_s: float) -> None:
        self.group = jax.process_count() > 1
        self.installed = _install_sigterm_handler()
        self.check_s = check_s
        self.notice = False
        self.next_check: int | None = None
        self.last: tuple[int, float] | None = None  # (step, time) of the last exchange
        self.snapshot_every = 1  # the steps between in-memory snapshots, agreed at the exchanges

    def close(self) -> None:
        if self.installed:
            self.installed = False
            _uninstall_sigterm_handler()

    def reached(self, step: int, snapshot_every: int = 1) -> bool:
        """Called once per step with the same steps on every process; True on all of them at one step.

        ``snapshot_every``: this process's proposal for the interval of in-memory snapshots
        (``jddp.checkpoint.snapshot``); ``self.snapshot_every`` becomes the largest proposal at each exchange (alone:
        the proposal), so that every process takes its snapshots at the same steps."""
        self.notice = self.notice or _SIGTERM.is_set() or (self.group and _jax_sync_point(step))
        if not self.group:
            self.snapshot_every = snapshot_every
            return self.notice
        if self.next_check is not None and step < self.next_check:
            return False
        now = time.monotonic()
        interval = 1
        if self.last is not None and now > self.last[1]:
            per_step = (now - self.last[1]) / max(step - self.last[0], 1)
            interval = int(min(max(self.check_s / per_step, 1), self.MAX_INTERVAL))
        dispatch.DISPATCHER.drain()  # no other program with collectives in flight (docs/jax_notes.md: deadlock)
        from jax.experimental import multihost_utils

        with watchdog.waiting():
            mine = np.asarray([int(self.notice), interval, snapshot_every], np.int32)
            rows = np.asarray(multihost_utils.process_allgather(mine))
        rows = rows.reshape(jax.process_count(), 3)
        self.next_check = step + int(rows[0, 1])  # process 0's proposal, the same everywhere
        self.snapshot_every = int(rows[:, 2].max())
        self.last = (step, time.monotonic())
        return bool(rows[:, 0].max())


def _jax_sync_point(step: int) -> bool:
    from jax.experimental import multihost_utils

    try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError:  # the preemption service is off (jax_enable_preemption_service=False)
        return False
