"""A watchdog's link to its group: key-value calls with a deadline, its mark and summary, and ending the process.

``GroupLink`` is the part of the watchdog thread (``jddp.runtime.watchdog.Watchdog``, its subclass) that talks to
the coordination service and ends the process; the rounds that judge the group are the subclass's.

Nothing here waits on the coordinator without a deadline: each key-value call runs in a helper thread and counts as
the coordinator lost after ``peer_timeout_s`` (a frozen process 0 answers nothing, and gRPC has no deadline of its
own here).

Ending: the process says why on stderr, marks itself (``LOST``, ``FAILED``, ``STALLED``) for its peers, leaves its
launcher a note under ``jddp launch`` (``note``: the peers it found silent, which the launcher then SIGKILLs at once,
the cause it found, or an early end), and exits with its code; process 0, which may host the coordination service,
lingers until its peers have seen the mark.

Under ``jddp launch`` the watchdog also watches the launcher, its parent: a
launcher that is gone (SIGKILLed, crashed, its node's agent killed) can
neither restart the group nor read its output, and its coordination service
stops ``SERVICE_GRACE_S`` (10 s) later, after which JAX would abort every
process from C++ (SIGABRT). Within a round, each process says so on stderr,
removes the launcher's ``jddp-launch-*`` folder (which only the launcher
reads) and points its output at ``/dev/null`` (the pipes lead nowhere now);
then, with a ``Checkpointer`` open, it takes the preemption path (every
process saves the agreed step and exits 75), else it exits 69 naming the
launcher. Under a launcher of this version this is the fallback: its orphan
watcher (``jddp.cli.launch.orphans``) ends the processes within a second of
the launcher's death and removes the folder itself, so the preemption save
is reached only where the watcher is gone too (killed with its launcher's
whole process tree but not the workers).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import sys
import threading
import time

from jddp import envvars, exitcodes
from jddp.runtime import heartbeats, progress

MAX_ROUND_S = 1.0  # the longest time between two watchdog rounds, whatever the peer timeout
NOTE_FILE = "note-{}.json"  # in the launcher's folder: what this process tells it (``GroupLink.note``)
LAUNCH_FOLDER_PREFIX = "jddp-launch-"  # jddp.cli.launch's temporary folder (JDDP_LEDGER_NOTE's parent)


def silence_output() -> None:
    """Points this process's output (fds 1 and 2, and Python's own stdout pipe under the launcher) at /dev/null: a
    launcher that is gone reads none of it, and a write to its pipes would raise BrokenPipeError in the script."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    fds = {1, 2}
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            fds.add(stream.fileno())
    for fd in fds:
        with contextlib.suppress(OSError):
            os.dup2(devnull, fd)


class GroupLink(threading.Thread):
    """The watchdog thread's state, its calls to the coordination service and its ways of ending the process; see
    the module docstring. ``jddp.runtime.watchdog.Watchdog`` adds the rounds."""

    def __init__(self, client, process_id: int, num_processes: int, coordinator: str | None, peer_timeout_s: float):
        super().__init__(name="jddp-peer-watchdog", daemon=True)
        self.client = client
        self.process_id, self.num_processes = process_id, num_processes
        self.coordinator, self.peer_timeout_s = coordinator, peer_timeout_s
        # A round at most every MAX_ROUND_S: the stall detector names a stall a few rounds after its bound, so
        # T / 10 alone made that delay grow with the peer timeout (bound + 9 to 11 s at T = 30 s).
        self.interval = max(0.05, min(peer_timeout_s / 10, MAX_ROUND_S))
        # Under jddp launch (which sets JDDP_LEDGER_NOTE for its workers only): the launcher is this process's parent.
        self.note_path = envvars.get("JDDP_LEDGER_NOTE")
        self.launcher = os.getppid() if self.note_path else None
        self.counter = 0  # the heartbeat's round counter
        self.launcher_gone = False
        self.state: str | None = None  # None while running, then DONE or FAILED
        self.stopped = threading.Event()
        self.key = f"{heartbeats.ALIVE_PREFIX}{process_id}"
        self.waiting_since: float | None = None  # set while the main thread waits in a jddp call (``waiting``)
        self.peers_gone: str | None = None  # after DONE: why waiting for the peers is pointless
        self._last_values: dict[int, str] = {}  # the aggregator's last read of the heartbeats
        self._last_summary: heartbeats.Summary | None = None  # and the last summary it published
        self.summary_change = time.monotonic()  # when the aggregator's summary last moved (the others' watchdogs)
        # Key-value calls run in a daemon thread of their own (not an executor: Python's shutdown joins those
        # and refuses new work before the atexit hook below runs).
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="jddp-watchdog-kv", daemon=True).start()

    def _serve(self) -> None:
        while True:
            fn, args, kwargs, done, box = self._calls.get()
            try:
                box.append((True, fn(*args, **kwargs)))
            except BaseException as error:
                box.append((False, error))
            done.set()

    def call(self, fn, *args, timeout_s: float | None = None, **kwargs):
        """``fn(*args, **kwargs)`` on the coordinator, or ``TimeoutError`` after ``timeout_s``: a frozen coordinator
        never answers, and this thread must not wait for it forever."""
        done, box = threading.Event(), []
        self._calls.put((fn, args, kwargs, done, box))
        if not done.wait(self.peer_timeout_s if timeout_s is None else timeout_s):
            raise TimeoutError(f"no answer from the coordinator to {getattr(fn, '__name__', fn)}")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def _publish_summary(
        self,
        values: dict[int, str],
        silent: list[int],
        mismatch: progress.Mismatch | None,
        *,
        stalled: bool = False,
        own: str | None = None,
    ) -> None:
        """The aggregator's round, for every other watchdog (``SUMMARY_KEY``): the processes that ended and how
        (this one's ``own`` state, or its state), the ones silent for the peer timeout, a call mismatch judged, a
        stall judged."""
        self._last_values = values
        states = {p: v for p, v in values.items() if v in heartbeats.ENDED and p != self.process_id}
        if (own or self.state) is not None:
            states[self.process_id] = own or self.state  # type: ignore[assignment]
        self._last_summary = heartbeats.Summary(self.counter, states, silent, mismatch, stalled)
        with contextlib.suppress(Exception):
            text = self._last_summary.text()
            self.call(self.client.key_value_set, heartbeats.SUMMARY_KEY, text, allow_overwrite=True, timeout_s=2.0)

    def _republish(self, own: str | None = None, silent: list[int] | None = None) -> None:
        """The aggregator's last summary again, with its own state now (``own``, or its state) and ``silent`` if
        given: what it found stays published as it ends (a call mismatch, the silent processes)."""
        last = self._last_summary
        self._publish_summary(
            self._last_values,
            silent if silent else (last.silent if last is not None else []),
            last.mismatch if last is not None else None,
            stalled=last.stalled if last is not None else False,
            own=own,
        )

    def _everyone(self) -> dict[int, str]:
        """Every process's heartbeat value, read once (the aggregator's read, or a stopping process's)."""
        values, _, _ = heartbeats.entries(
            self.call(self.client.key_value_dir_get, heartbeats.ALIVE_PREFIX, timeout_s=2.0)
        )
        return values

    def _states(self) -> dict[int, str]:
        """The processes that ended and how (DONE, FAILED, ...): for the aggregator from every heartbeat, for the
        others from the aggregator's summary (theirs as the aggregator saw it, a round ago at most)."""
        if self.process_id == heartbeats.AGGREGATOR:
            return {p: v for p, v in self._everyone().items() if v in heartbeats.ENDED}
        summary = heartbeats.parse_summary(
            self.call(heartbeats.try_get, self.client, heartbeats.SUMMARY_KEY, timeout_s=2.0)
        )
        return dict(summary.states) if summary is not None else {}

    def _launcher_lost(self) -> None:
        """The launcher (this process's parent) is gone: see the module docstring."""
        self.launcher_gone = True
        folder = os.path.dirname(self.note_path or "")
        if os.path.basename(folder).startswith(LAUNCH_FOLDER_PREFIX):
            shutil.rmtree(folder, ignore_errors=True)
        message = (
            f"jddp: process {self.process_id} of {self.num_processes}: its launcher (pid {self.launcher}, "
            "jddp launch) is gone: nothing will restart this group or read its output"
        )
        with contextlib.suppress(OSError):
            os.write(2, (message + "; ").encode())
        silence_output()
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):  # a Checkpointer's preemption handler: every process saves the agreed step, exits 75
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self._end(f"lost its launcher (pid {self.launcher}, jddp launch): killed or crashed")

    def _end(self, reason: str, *, shutdown: bool = False, silent: list[int] | None = None) -> None:
        """A running process exits with 69; one that is exiting already (DONE) stops waiting for its peers."""
        if self.state is None:
            self._fail(reason, shutdown=shutdown, silent=silent)
        self.peers_gone = reason

    def note(self, **fields) -> None:
        """Under ``jddp launch``: a note for the launcher (``jddp.cli.launch`` reads ``note-<process>.json`` in its
        folder): the peers this process found silent (stopped at once there), the cause it found, an early end."""
        folder = os.path.dirname(self.note_path or "")
        if self.launcher_gone or not os.path.basename(folder).startswith(LAUNCH_FOLDER_PREFIX):
            return
        path = os.path.join(folder, NOTE_FILE.format(self.process_id))
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as f:
                json.dump({"process": self.process_id, **fields}, f)
            os.replace(path + ".tmp", path)

    def _fail(
        self,
        reason: str,
        *,
        shutdown: bool = False,
        code: int = exitcodes.EXIT_PEER_LOST,
        mark: str = heartbeats.LOST,
        silent: list[int] | None = None,
        cause: str | None = None,
    ) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        message = f"jddp: process {self.process_id} of {self.num_processes} {reason}; exiting with code {code}.\n"
        self.note(code=code, reason=reason, silent=sorted(silent or []), cause=cause)
        os.write(2, message.encode())
        with contextlib.suppress(Exception):  # tell the peers, briefly: the coordinator may be what was lost
            self.call(self.client.key_value_set, self.key, heartbeats.value(mark), allow_overwrite=True, timeout_s=2.0)
        if self.process_id == heartbeats.AGGREGATOR:  # the others read the aggregator's state from its summary
            self._republish(own=mark, silent=silent)
        if self.process_id == 0 and not shutdown:
            self.linger()
        if shutdown:
            # Every peer is alive (some exiting): meet them at JAX's shutdown barrier, which the ones at exit
            # reach once they see LOST. Without it, process 0's exit would take its coordination service away
            # and JAX would abort them (exit 134) instead of letting them exit with their own code.
            with contextlib.suppress(Exception):
                self.call(self.client.shutdown, timeout_s=min(10.0, self.peer_timeout_s))
        os._exit(code)

    def linger(self, limit_s: float | None = None) -> None:
        """Process 0 hosts the coordination service: its exit makes JAX abort every other process (exit 134). So
        it waits, briefly, until the others have ended or marked how they end (they see its mark within one
        round of their watchdogs), and only then exits."""
        deadline = time.monotonic() + (2 * self.interval + 1.0 if limit_s is None else limit_s)
        peers = set(range(self.num_processes)) - {self.process_id}
        while time.monotonic() < deadline:
            try:
                values, _, _ = heartbeats.entries(
                    self.call(self.client.key_value_dir_get, heartbeats.ALIVE_PREFIX, timeout_s=2.0)
                )
            except Exception:
                return
            if all(values.get(p) in heartbeats.ENDED for p in peers):
                time.sleep(self.interval)  # time for their exit to get past JAX's client
                return
            time.sleep(self.interval / 2)

    def mark(self, state: str) -> None:
        self.state = state
        with contextlib.suppress(Exception):
            self.call(self.client.key_value_set, self.key, heartbeats.value(state), allow_overwrite=True, timeout_s=5.0)
        if self.process_id == heartbeats.AGGREGATOR:
            self._republish()
