"""The main thread's side of peer liveness: ``waiting()`` around a wait for peers, and ``group_healthy()``.

``WATCHDOG`` is this process's watchdog thread once ``jddp.runtime.watchdog.start`` has started it (in a group),
else None; jddp's calls that wait for their peers (a step's output, an agreement) mark the wait here, so that the
watchdog does not wait longer than the peer timeout for a peer that ended early.
"""

from __future__ import annotations

import contextlib
import time

from jddp.runtime import group_link, heartbeats

WATCHDOG: group_link.GroupLink | None = None  # set by jddp.runtime.watchdog.start, once per process


def group_healthy() -> bool:
    """False once this process is ending because the group failed (an unhandled exception here, a lost peer, a
    stall): then nothing at exit may wait for the peers. True alone and in a group that is well."""
    return WATCHDOG is None or WATCHDOG.state in (None, heartbeats.DONE)


@contextlib.contextmanager
def waiting():
    """Around a jddp call where the main thread waits for peers (a step's output, an agreement): while it lasts,
    a peer that ended early (DONE) is not waited for longer than the peer timeout. Nests; free outside a group."""
    watchdog = WATCHDOG
    if watchdog is None or watchdog.waiting_since is not None:
        yield
        return
    watchdog.waiting_since = time.monotonic()
    try:
        yield
    finally:
        watchdog.waiting_since = None
