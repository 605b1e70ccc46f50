"""Peer liveness: the watchdog thread of every process of a group, and the exit hooks.

JAX's own behaviour when a peer dies is a hang in the next collective until the
coordination service's heartbeat timeout (100 s by default), then a C++ abort
with no Python cleanup. jddp adds a watchdog thread to every process of a group.
Every ``peer_timeout_s / 10`` seconds it writes a counter under
``jddp/alive/<process>`` in the coordination service's key-value store and reads
everyone's. It ends the process with ``EXIT_PEER_LOST`` (69) and one line on
stderr naming the lost process, when:

* a peer's counter has not moved for ``peer_timeout_s`` (30 s by default): the
  peer died, was killed, or is frozen;
* a peer reports that it ended with an unhandled exception (jddp marks that in
  ``sys.excepthook``): there is no point waiting for its collectives;
* the coordinator (process 0) no longer answers.

JAX's heartbeat timeout is set ``15 s`` above ``peer_timeout_s``, so the
watchdog speaks first and the C++ abort remains only as a backstop. A watchdog
that was itself starved of the GIL for more than half the timeout judges nobody
on that round, so a long pause in this process is not blamed on its peers. A
peer that ended normally (its script returned) is waited for at exit by a
barrier, which is what lets the last processes finish their work.

The exit hooks: ``sys.excepthook`` marks this process FAILED (after giving the
watchdog time to name a lost peer when a collective failed first), and an
``atexit`` hook marks it DONE and waits for every peer to finish.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time

from jddp import exitcodes
from jddp.runtime import jax_internals

ALIVE_PREFIX = "jddp/alive/"
DONE = "done"
FAILED = "failed"

_watchdog: Watchdog | None = None


def start(client, process_id: int, num_processes: int, coordinator: str | None, peer_timeout_s: float) -> Watchdog:
    """Starts this process's watchdog and installs the exit hooks (once per process)."""
    global _watchdog
    _watchdog = Watchdog(client, process_id, num_processes, coordinator, peer_timeout_s)
    _watchdog.start()
    _install_exit_hooks()
    return _watchdog


class Watchdog(threading.Thread):
    """Ends this process when a peer is lost; see the module docstring."""

    def __init__(self, client, process_id: int, num_processes: int, coordinator: str | None, peer_timeout_s: float):
        super().__init__(name="jddp-peer-watchdog", daemon=True)
        self.client = client
        self.process_id, self.num_processes = process_id, num_processes
        self.coordinator, self.peer_timeout_s = coordinator, peer_timeout_s
        self.interval = max(0.05, peer_timeout_s / 10)
        self.state: str | None = None  # None while running, then DONE or FAILED
        self.stopped = threading.Event()
        self.key = f"{ALIVE_PREFIX}{process_id}"

    def run(self) -> None:
        peers = [p for p in range(self.num_processes) if p != self.process_id]
        last_value: dict[int, str | None] = dict.fromkeys(peers)
        last_change = dict.fromkeys(peers, time.monotonic())
        last_round = time.monotonic()
        counter = 0
        while not self.stopped.wait(self.interval):
            counter += 1
            try:
                self.client.key_value_set(self.key, self.state or str(counter), allow_overwrite=True)
                entries = self.client.key_value_dir_get(ALIVE_PREFIX)
            except Exception as error:
                if (
                    self.stopped.is_set() or jax_internals.distributed_client() is None
                ):  # stopped, or jax.distributed.shutdown() was called
                    return
                self._fail(
                    f"lost the coordinator (process 0 at {self.coordinator}): "
                    f"{str(error).splitlines()[0] if str(error) else type(error).__name__}"
                )
            now = time.monotonic()
            starved = now - last_round > self.peer_timeout_s / 2
            last_round = now
            values = {int(k.rsplit("/", 1)[1]): v for k, v in entries}
            for p in peers:
                value = values.get(p)
                if value == FAILED:
                    self._fail(f"process {p} ended with an unhandled exception (see its output)")
                if value != last_value[p] or starved or value == DONE:
                    last_value[p], last_change[p] = value, now
            silent = [p for p in peers if now - last_change[p] > self.peer_timeout_s]
            if silent:
                self._fail(
                    f"lost process(es) {silent}: no sign of life for more than {self.peer_timeout_s:g} s "
                    "(killed, crashed or frozen)"
                )

    def _fail(self, reason: str) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        message = (
            f"jddp: process {self.process_id} of {self.num_processes} {reason}; "
            f"exiting with code {exitcodes.EXIT_PEER_LOST}.\n"
        )
        os.write(2, message.encode())
        os._exit(exitcodes.EXIT_PEER_LOST)

    def mark(self, state: str) -> None:
        self.state = state
        try:
            self.client.key_value_set(self.key, state, allow_overwrite=True)
        except Exception:
            pass


def _install_exit_hooks() -> None:
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        previous_hook(kind, value, traceback)
        watchdog = _watchdog
        if watchdog is None or issubclass(kind, KeyboardInterrupt):
            return
        if _is_collective_failure(value):
            # gloo noticed a closed connection before the watchdog noticed the silence; give the watchdog time
            # to name the lost process (it ends this process), and only then blame this process.
            print(
                f"jddp: a collective failed on process {watchdog.process_id}; waiting up to "
                f"{watchdog.peer_timeout_s:g} s to find out which peer is lost",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(watchdog.peer_timeout_s + 3 * watchdog.interval)
        watchdog.mark(FAILED)

    sys.excepthook = excepthook
    atexit.register(_at_exit)


def _is_collective_failure(error: BaseException) -> bool:
    # XLA surfaces a broken gloo connection as JaxRuntimeError or, from some call sites, ValueError.
    text = str(error)
    return any(marker in text for marker in ("Gloo", "Connection closed by peer", "Connection reset by peer"))


def _at_exit() -> None:
    """Finished normally: wait for the others (the watchdog still guards us), then let JAX shut down."""
    watchdog = _watchdog
    if watchdog is None or not watchdog.is_alive():
        return
    if watchdog.state == FAILED:
        # Peers stop on the mark; waiting for them at a barrier would only delay the exit.
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(1)
    watchdog.mark(DONE)
    # Wait for every peer to finish, however long its remaining work takes: the watchdog (still running) ends
    # this process if a peer dies or fails meanwhile. Only then does JAX's own time-limited shutdown barrier run.
    peers = set(range(watchdog.num_processes)) - {watchdog.process_id}
    while True:
        try:
            values = {int(k.rsplit("/", 1)[1]): v for k, v in watchdog.client.key_value_dir_get(ALIVE_PREFIX)}
        except Exception:
            break  # the coordinator is gone: nothing left to wait for
        if all(values.get(p) in (DONE, FAILED) for p in peers):
            break
        time.sleep(watchdog.interval)
    watchdog.stopped.set()
    watchdog.join(timeout=5)
