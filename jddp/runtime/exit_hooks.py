"""The exit hooks of a process in a group: how it ends when its script raises, returns or exits.

``sys.excepthook`` marks this process FAILED (after giving the watchdog time to name a lost peer when a collective
failed first); an ``atexit`` hook marks it DONE and waits for every peer to finish; a hook among threading's own
ends a FAILED process before Python joins threads that wait for its peers; under ``jddp launch``, the launcher's
``FLUSH_SIGNAL`` before a restart's SIGKILL flushes and exits (``jddp.runtime.flush``). gloo's fixed 30-s
window of a first collective running out in a program of the script's own is explained before the rest
(``jddp.runtime.first_run``). ``jddp.runtime.watchdog.start``
installs them with the watchdog (``peer_wait.WATCHDOG``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time

from jddp.runtime import first_run, flush, heartbeats, peer_wait

# Python's hook list for what must run at shutdown before non-daemon threads are joined and before
# concurrent.futures refuses new work (its own shutdown is one of them; newest first). A private name of the
# threading module since Python 3.9; where it is missing, atexit, which runs later.
at_shutdown = getattr(threading, "_register_atexit", atexit.register)


def install() -> None:
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        watchdog = peer_wait.WATCHDOG
        if watchdog is not None and watchdog.state == heartbeats.STALLED and is_collective_failure(value):
            # A peer that stalled with this one exited first: its watchdog ends this process in a moment, and
            # the broken collective is a consequence, not news.
            time.sleep(watchdog.peer_timeout_s)
        previous_hook(kind, value, traceback)
        if watchdog is None or issubclass(kind, KeyboardInterrupt):
            return
        if first_run.is_gloo_window(value) and not isinstance(value, TimeoutError):
            # gloo's 30-s window of a first collective ran out where jddp did not explain it (a step's metrics read
            # after the run, a program of the script's own): say what it is and what to do.
            from jddp.runtime import dispatch  # here: this module is imported by the launcher's side, without JAX

            pending = dispatch.DISPATCHER.in_flight()  # jddp's programs whose outputs were not waited for yet
            what = ", ".join(pending) if pending else "a collective"
            print(f"jddp: {first_run.gloo_window_message(value, what, met=bool(pending))}", file=sys.stderr)
        if is_collective_failure(value):
            # gloo noticed a closed connection before the watchdog noticed the silence; give the watchdog time
            # to name the lost process (it ends this process), and only then blame this process.
            print(
                f"jddp: a collective failed on process {watchdog.process_id}; waiting up to "
                f"{watchdog.peer_timeout_s:g} s to find out which peer is lost, or which call the processes made "
                "apart",
                file=sys.stderr,
                flush=True,
            )
            watchdog.waiting_since = time.monotonic()  # waits for its peers: a call mismatch is judged meanwhile
            time.sleep(watchdog.peer_timeout_s + 3 * watchdog.interval)
        watchdog.mark(heartbeats.FAILED)

    sys.excepthook = excepthook
    atexit.register(_at_exit)
    # A failed process must not wait at exit for a non-daemon thread that waits for its peers (Orbax's commit of
    # an async save, at a barrier the peers that exited 69 never reach): Python joins those threads before the
    # atexit hooks run, so this exit path is among threading's own hooks, which run first.
    at_shutdown(_exit_if_failed)
    # Under jddp launch: a restart's SIGUSR2 flushes the script's files, logging and stdout before the SIGKILL.
    flush.install()


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed on a broken connection (a peer lost or cut off)."""
    # XLA surfaces a broken gloo connection as JaxRuntimeError or, from some call sites, ValueError.
    text = str(error)
    return any(marker in text for marker in ("Gloo", "Connection closed by peer", "Connection reset by peer"))


def _exit_if_failed() -> None:
    """Ended by an unhandled exception (marked FAILED): exit 1 now. Peers stop on the mark; waiting for them
    (at a barrier, or in a thread of Orbax's) would only delay the exit, or never end; process 0 waits until they
    have seen it, since its exit would abort them."""
    watchdog = peer_wait.WATCHDOG
    if watchdog is None or not watchdog.is_alive() or watchdog.state != heartbeats.FAILED:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if watchdog.process_id == 0:
        watchdog.linger(limit_s=watchdog.peer_timeout_s)
    os._exit(1)


def _at_exit() -> None:
    """Finished normally: wait for the others (the watchdog still guards us), then let JAX shut down."""
    watchdog = peer_wait.WATCHDOG
    if watchdog is None or not watchdog.is_alive():
        return
    _exit_if_failed()
    watchdog.mark(heartbeats.DONE)
    # Wait for every peer to finish, however long its remaining work takes: the watchdog (still running) ends
    # this process if a peer dies or fails meanwhile. Only then does JAX's own time-limited shutdown barrier run.
    peers = set(range(watchdog.num_processes)) - {watchdog.process_id}
    while watchdog.peers_gone is None:
        try:
            states = watchdog._states()
        except Exception:
            break  # the coordinator is gone: nothing left to wait for
        if (
            watchdog.process_id != heartbeats.AGGREGATOR
            and time.monotonic() - watchdog.summary_change > watchdog.peer_timeout_s
        ):
            break  # the aggregator's summary stopped (it ended, or is gone): nothing more will be learned from it
        if all(states.get(p) in heartbeats.ENDED for p in peers):
            if watchdog.process_id == heartbeats.AGGREGATOR:
                # the others wait for the same in the summary, and this watchdog's rounds stop below: the last
                # ends it saw must be published now, or those still waiting would wait for them forever
                with contextlib.suppress(Exception):
                    watchdog._publish_summary(watchdog._everyone(), [], None)
            break
        time.sleep(watchdog.interval)
    with contextlib.suppress(Exception):
        states = watchdog._states()
        lost = sorted(p for p in peers if states.get(p) == heartbeats.LOST)
        if lost:  # they stopped waiting for this process, which had ended: the run failed, whatever its exit code
            watchdog.note(early=True, reason=f"ended while process(es) {lost} still needed it; they stopped (69)")
    watchdog.stopped.set()
    watchdog.join(timeout=5)
