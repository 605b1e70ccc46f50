"""Peer liveness: the watchdog thread of every process of a group, and the exit hooks.

JAX's own behaviour when a peer dies is a hang in the next collective until the
coordination service's heartbeat timeout (100 s by default), then a C++ abort
with no Python cleanup. jddp adds a watchdog thread to every process of a group.
Every round (``peer_timeout_s / 10`` seconds, at most ``MAX_ROUND_S``) it writes a counter under
``jddp/alive/<process>`` in the coordination service's key-value store. One watchdog, the aggregator's
(process 0's), reads every counter, judges the group and publishes what it found as one small value
(``Summary`` under ``SUMMARY_KEY``: who ended and how, who went silent, a call mismatch, a stall); every
other watchdog reads only that value. A round thus costs the service O(N) values, not N^2 (at 1024
processes 235 MB a round before, ``benchmarks/control_plane.py``); a process learns what the aggregator
found a round later at most, and the aggregator's own silence (its summary not moving for
``peer_timeout_s``) is judged by every other process as a peer's would be. It ends the process with
``EXIT_PEER_LOST`` (69) and one line on stderr naming the lost process, when:

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

A process that ends early without an exception (``sys.exit`` with any code, a
``return`` from ``main`` before the others are done) is marked DONE by the
``atexit`` hook and waits for its peers there; a peer that then waits in a jddp
call that needs it (a step's output, metrics, an agreement: ``waiting()``) for
``peer_timeout_s`` ends with 69 naming it, instead of waiting forever. A process
that ends with 69 marks itself LOST first, so that a DONE process waiting for
it exits at once, with its own code.

Nothing in the watchdog waits on the coordinator without a deadline: each
key-value call runs in a helper thread and counts as the coordinator lost after
``peer_timeout_s`` (a frozen process 0 answers nothing, and gRPC has no
deadline of its own here). Where process 0 hosts the coordination service
(JAX's default, without ``jddp launch``), a SIGKILLed process 0 takes it along,
and JAX's client aborts the survivors from C++ at once (exit 134, "the
distributed service detected fatal errors"); JAX 0.10's
``missed_heartbeat_callback`` would let Python act first but throws
``std::bad_cast`` when given a Python callable. ``jddp launch`` therefore runs
the service in a process of its own (``jddp.runtime.coordinator``): there
losing process 0 is like losing any other.

Under ``jddp launch`` the watchdog also watches the launcher, its parent: a
launcher that is gone (SIGKILLed, crashed, its node's agent killed) can
neither restart the group nor read its output, and its coordination service
stops ``SERVICE_GRACE_S`` (10 s) later, after which JAX would abort every
process from C++ (SIGABRT). Within a round, each process says so on stderr,
removes the launcher's ``jddp-launch-*`` folder (which only the launcher
reads) and points its output at ``/dev/null`` (the pipes lead nowhere now);
then, with a ``Checkpointer`` open, it takes the preemption path (every
process saves the agreed step and exits 75), else it exits 69 naming the
launcher.

Collective calls: the heartbeat value also carries this process's jddp collective
calls (``progress.collective_call``: the number of the current one and the names of
the last few). When the processes made different calls at one number (a
``Checkpointer.save`` under ``if jax.process_index() == 0:`` against the others'
``DataParallel.step``) and every one of them has waited ``MISMATCH_S`` in its call,
or a peer failed meanwhile, each stops naming the call and the processes that made
it: those exit 1, the others 69. A message about a lost peer says where each process
was among these calls. Under ``jddp launch`` each process leaves its launcher a note
as it stops (``note``): the peers it found silent, which the launcher then SIGKILLs
at once, the cause it found, or an early end.

The exit hooks: ``sys.excepthook`` marks this process FAILED (after giving the
watchdog time to name a lost peer when a collective failed first), and an
``atexit`` hook marks it DONE and waits for every peer to finish.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import json
import os
import queue
import shutil
import signal
import sys
import threading
import time

from jddp import envvars, exitcodes
from jddp.runtime import jax_internals, progress

MAX_ROUND_S = 1.0  # the longest time between two watchdog rounds, whatever the peer timeout
# How long the processes of a collective call mismatch (``progress.mismatch``) must all wait in it before they
# stop: a host collective of two kinds at one place raises by itself in far less (``jddp.runtime.host``).
MISMATCH_S = 3.0
NOTE_FILE = "note-{}.json"  # in the launcher's folder: what this process tells it (``Watchdog.note``)

ALIVE_PREFIX = "jddp/alive/"
DONE = "done"
FAILED = "failed"
LOST = "lost"  # ended with EXIT_PEER_LOST
STALLED = "stalled"  # ended with EXIT_STALLED
ENDED = (DONE, FAILED, LOST, STALLED)
STALL_KEY = f"{ALIVE_PREFIX}stall"  # the verdict: JSON, set by the first watchdog that sees the group stalled
WHERE_PREFIX = "jddp/where/"  # after a stall: each process's main-thread frame

# One watchdog, the aggregator's, reads every heartbeat each round and publishes what it found under SUMMARY_KEY;
# every other watchdog writes its own heartbeat and reads only that summary: O(N) values at the service a round,
# where every watchdog reading every heartbeat was O(N^2) (235 MB a round at 1024 processes).
AGGREGATOR = 0
SUMMARY_KEY = "jddp/summary"  # not under ALIVE_PREFIX: the aggregator's read of the heartbeats leaves it out

_watchdog: Watchdog | None = None


@dataclasses.dataclass(frozen=True)
class Summary:
    """The aggregator's round as the other watchdogs read it: its round counter (moving while it lives), the
    processes that ended and how, the ones it found silent for the peer timeout, a call mismatch it judged, and
    whether it judged the group stalled (the verdict itself is under ``STALL_KEY``). Small whatever N while the
    group is well: the lists name only the processes that ended or went silent."""

    round: int
    states: dict[int, str]
    silent: list[int]
    mismatch: progress.Mismatch | None
    stalled: bool

    def text(self) -> str:
        found = self.mismatch
        return json.dumps(
            {
                "round": self.round,
                "states": {v: _runs(sorted(p for p, w in self.states.items() if w == v)) for v in ENDED},
                "silent": self.silent,
                "mismatch": None if found is None else {"seq": found.seq, "groups": found.groups, "odd": found.odd},
                "stalled": self.stalled,
            },
            separators=(",", ":"),
        )


def _parse_summary(text: str | None) -> Summary | None:
    """The summary ``Summary.text`` wrote, or None (not published yet)."""
    if text is None:
        return None
    d = json.loads(text)
    m = d["mismatch"]
    found = None if m is None else progress.Mismatch(m["seq"], {k: tuple(v) for k, v in m["groups"].items()}, m["odd"])
    states = {p: v for v, runs in d["states"].items() for first, last in runs for p in range(first, last + 1)}
    return Summary(d["round"], states, list(d["silent"]), found, d["stalled"])


def _runs(processes: list[int]) -> list[list[int]]:
    """Sorted process indices as runs ``[first, last]``: the ends of a whole group of 1024 are one run, a few
    bytes, for every watchdog that reads them."""
    runs: list[list[int]] = []
    for p in processes:
        if runs and runs[-1][1] == p - 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return runs


def _try_get(client, key: str) -> str | None:
    """The value of ``key`` in the coordination service's store, or None when it has none."""
    try:
        return client.key_value_try_get(key)
    except Exception as error:
        if "NOT_FOUND" in str(error):
            return None
        raise


def _silent_reason(silent: list[int], peer_timeout_s: float) -> str:
    return f"lost process(es) {silent}: no sign of life for more than {peer_timeout_s:g} s (killed, crashed or frozen)"


def _entries(entries) -> tuple[dict[int, str], str | None, dict[int, progress.Calls]]:
    """The heartbeat values by process (their state, or their progress while running), the stall verdict if one
    was published, and each process's collective calls (published after a ``|`` in the same value)."""
    values, verdict, calls = {}, None, {}
    for key, value in entries:
        name = key.rsplit("/", 1)[1]
        if name.isdigit():
            value, _, text = value.partition("|")
            values[int(name)] = value
            parsed = progress.Calls.parse(text)
            if parsed is not None:
                calls[int(name)] = parsed
        elif key == STALL_KEY:
            verdict = value
    return values, verdict, calls


def _value(state: str) -> str:
    """A heartbeat value: the state (or progress), then this process's collective calls."""
    return f"{state}|{progress.calls_text()}"


LAUNCH_FOLDER_PREFIX = "jddp-launch-"  # jddp.cli.launch's temporary folder (JDDP_LEDGER_NOTE's parent)


def _silence_output() -> None:
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


def start(client, process_id: int, num_processes: int, coordinator: str | None, peer_timeout_s: float) -> Watchdog:
    """Starts this process's watchdog and installs the exit hooks (once per process)."""
    global _watchdog
    _watchdog = Watchdog(client, process_id, num_processes, coordinator, peer_timeout_s)
    _watchdog.start()
    _install_exit_hooks()
    progress.ANNOUNCE = _watchdog.announce
    # A process that gloo aborts from C++ (a collective made by a subset of the processes: "Received data size
    # doesn't match") prints where its Python threads were, the script's call among them.
    with contextlib.suppress(ValueError, OSError, RuntimeError, AttributeError):
        if sys.__stderr__ is not None and not faulthandler.is_enabled():
            faulthandler.enable(file=sys.__stderr__)
    return _watchdog


class Watchdog(threading.Thread):
    """Ends this process when a peer is lost; see the module docstring."""

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
        self.mismatch_key: object = None  # the call mismatch seen (``_stuck``), and since when
        self.mismatch_since = 0.0
        self.counter = 0  # the heartbeat's round counter
        self.launcher_gone = False
        self.state: str | None = None  # None while running, then DONE or FAILED
        self.stopped = threading.Event()
        self.key = f"{ALIVE_PREFIX}{process_id}"
        self.waiting_since: float | None = None  # set while the main thread waits in a jddp call (``waiting``)
        self.peers_gone: str | None = None  # after DONE: why waiting for the peers is pointless
        self._last_values: dict[int, str] = {}  # the aggregator's last read of the heartbeats
        self._last_summary: Summary | None = None  # and the last summary it published
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

    def announce(self) -> None:
        """Publishes this process's heartbeat value now, with its collective calls (from the main thread, as a
        collective call begins: ``progress.collective_call``); gives up after a second."""
        if self.state is not None or self.stopped.is_set():
            return
        value = _value(progress.publish(self.counter, self.waiting_since is not None))
        with contextlib.suppress(Exception):
            self.call(self.client.key_value_set, self.key, value, allow_overwrite=True, timeout_s=1.0)

    def run(self) -> None:
        try:
            self._watch()
        finally:
            faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        peers = [p for p in range(self.num_processes) if p != self.process_id]
        last_value: dict[int, str | None] = dict.fromkeys(peers)
        last_change = dict.fromkeys(peers, time.monotonic())
        last_round = time.monotonic()
        self.counter = 0
        everyone = range(self.num_processes)
        last_ticks: dict[int, int | None] = dict.fromkeys(everyone)
        last_tick_seen = dict.fromkeys(everyone, time.monotonic())
        aggregating = self.process_id == AGGREGATOR
        summary_round: int | None = None  # the aggregator's round last read (another process's watchdog)
        summary_change = self.summary_change = time.monotonic()
        _arm_stack_dump(self.peer_timeout_s)  # from the start: a script may take the GIL before the first round
        while not self.stopped.wait(self.interval):
            # Re-armed every round: if this thread cannot run for the peer timeout (C code holding the GIL, the
            # case where the peers declare this process lost), Python's faulthandler prints every thread's stack
            # to stderr from a C thread of its own ("Timeout (0:00:30)!"), so the stuck process says where it is.
            _arm_stack_dump(self.peer_timeout_s)
            self.counter += 1
            if self.launcher is not None and not self.launcher_gone and os.getppid() != self.launcher:
                self._launcher_lost()
            try:
                value = _value(self.state or progress.publish(self.counter, self.waiting_since is not None))
                self.call(self.client.key_value_set, self.key, value, allow_overwrite=True)
                if aggregating:
                    entries = self.call(self.client.key_value_dir_get, ALIVE_PREFIX)
                else:
                    summary = _parse_summary(self.call(_try_get, self.client, SUMMARY_KEY))
            except Exception as error:
                if (
                    self.stopped.is_set() or jax_internals.distributed_client() is None
                ):  # stopped, or jax.distributed.shutdown() was called
                    return
                if isinstance(error, TimeoutError):
                    why = f"no answer for {self.peer_timeout_s:g} s (frozen or unreachable)"
                else:
                    why = str(error).splitlines()[0] if str(error) else type(error).__name__
                self._end(f"lost the coordinator (process 0 at {self.coordinator}): {why}")
                return
            now = time.monotonic()
            starved = now - last_round > self.peer_timeout_s / 2
            last_round = now
            if not aggregating:
                # Every other watchdog acts on the aggregator's summary: one small value a round, whatever N.
                if summary is not None and (summary.round != summary_round or starved):
                    summary_round, summary_change = summary.round, now
                elif starved:
                    summary_change = now
                self.summary_change = summary_change
                if self._follow(summary, now - summary_change, peers):
                    return
                continue
            values, verdict, calls = _entries(entries)
            calls[self.process_id] = progress.Calls.parse(progress.calls_text())  # type: ignore[assignment]
            if verdict is not None and self.state is None:
                self._publish_summary(values, [], None, stalled=True)
                self._stalled(verdict, values)
                return
            reason = None
            for p in peers:
                value = values.get(p)
                if value == FAILED:
                    reason = f"process {p} ended with an unhandled exception (see its output)"
                elif value == LOST:
                    reason = f"process {p} lost a peer and ended (exit {exitcodes.EXIT_PEER_LOST})"
                if value != last_value[p] or starved or value == DONE:
                    last_value[p], last_change[p] = value, now
            silent = [p for p in peers if now - last_change[p] > self.peer_timeout_s]
            if silent:
                reason = _silent_reason(silent, self.peer_timeout_s)
            found = progress.mismatch({p: c for p, c in calls.items() if values.get(p) != DONE})
            if (
                found is not None
                and self.state is None
                and (reason is not None or self._stuck(found, values, calls, now))
            ):
                self._publish_summary(values, silent, found)
                self._mismatched(found, reason)
                return
            verdict = None
            if reason is None and self.state is None and progress.PROGRESS.settings.enabled:
                seen = {p: progress.Seen.parse(values.get(p)) for p in everyone}
                for p, s in seen.items():
                    if s is not None and (s.ticks != last_ticks[p] or starved):
                        last_ticks[p], last_tick_seen[p] = s.ticks, now
                verdict = self._judge(seen, now - max(last_tick_seen.values()))
                if verdict is not None:
                    with contextlib.suppress(Exception):
                        self.call(self.client.key_value_set, STALL_KEY, verdict, allow_overwrite=True)
            self._publish_summary(values, silent, None, stalled=verdict is not None)
            if verdict is not None:
                self._stalled(verdict, values)
                return
            if self._act(reason, values, calls, peers, silent, now):
                return

    def _act(
        self,
        reason: str | None,
        values: dict[int, str],
        calls: dict[int, progress.Calls],
        peers: list[int],
        silent: list[int],
        now: float,
    ) -> bool:
        """A round's end, the same for every watchdog: stops this process on ``reason`` (a lost or failed peer),
        or once it has waited ``peer_timeout_s`` in a call for peers that ended early; True when it stopped."""
        if reason is not None and self.state is None:
            reason += "; " + self._calls_clause(calls, values)
        ended = [p for p in peers if values.get(p) == DONE]
        since = self.waiting_since
        shutdown = False
        if reason is None and ended and since is not None and now - since > self.peer_timeout_s:
            reason = (
                f"waited {now - since:.0f} s for process(es) {ended}, which ended early (returned from the "
                "script or called sys.exit; the exit code is in its output and the launcher's summary) while "
                "this one still needed them"
            )
            shutdown = True  # nobody is dead: leave the group cleanly, so that the DONE ones exit with their code
        if reason is None:
            return False
        self._end(reason, shutdown=shutdown, silent=silent)
        return True

    def _follow(self, summary: Summary | None, stale_s: float, peers: list[int]) -> bool:
        """A round of a watchdog other than the aggregator's: acts on the aggregator's ``summary`` (what it found
        of every process), or names the aggregator lost when its summary has not moved for ``peer_timeout_s``
        (``stale_s``); True when this process stopped."""
        values = dict(summary.states) if summary is not None else {}
        silent = [p for p in (summary.silent if summary is not None else []) if p != self.process_id]
        if stale_s > self.peer_timeout_s and values.get(AGGREGATOR) not in ENDED:
            silent = sorted({*silent, AGGREGATOR})
        if summary is not None and summary.stalled and self.state is None and not silent:
            with contextlib.suppress(Exception):
                verdict = self.call(_try_get, self.client, STALL_KEY, timeout_s=2.0)
                if verdict is not None:
                    self._stalled(verdict, self._everyone())
                    return True
        reason = None
        for p in peers:
            if values.get(p) == FAILED:
                reason = f"process {p} ended with an unhandled exception (see its output)"
            elif values.get(p) == LOST:
                reason = f"process {p} lost a peer and ended (exit {exitcodes.EXIT_PEER_LOST})"
        if silent:
            reason = _silent_reason(silent, self.peer_timeout_s)
        if summary is not None and summary.mismatch is not None and self.state is None:
            self._mismatched(summary.mismatch, reason)
            return True
        calls: dict[int, progress.Calls] = {}
        if reason is not None and self.state is None:
            # Once, as this process stops: every process's calls for the message (the only read of all N values)
            with contextlib.suppress(Exception):
                everyone, _, calls = _entries(self.call(self.client.key_value_dir_get, ALIVE_PREFIX, timeout_s=2.0))
                values = {**everyone, **values}
            calls[self.process_id] = progress.Calls.parse(progress.calls_text())  # type: ignore[assignment]
            # A call made apart, seen in that read: named as the aggregator would have (it may be what gloo aborted
            # for that call: then nobody else judges it)
            found = progress.mismatch({p: c for p, c in calls.items() if values.get(p) != DONE})
            if found is not None:
                self._mismatched(found, reason)
                return True
        return self._act(reason, values, calls, peers, silent, time.monotonic())

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
        states = {p: v for p, v in values.items() if v in ENDED and p != self.process_id}
        if (own or self.state) is not None:
            states[self.process_id] = own or self.state  # type: ignore[assignment]
        self._last_summary = Summary(self.counter, states, silent, mismatch, stalled)
        with contextlib.suppress(Exception):
            text = self._last_summary.text()
            self.call(self.client.key_value_set, SUMMARY_KEY, text, allow_overwrite=True, timeout_s=2.0)

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
        values, _, _ = _entries(self.call(self.client.key_value_dir_get, ALIVE_PREFIX, timeout_s=2.0))
        return values

    def _states(self) -> dict[int, str]:
        """The processes that ended and how (DONE, FAILED, ...): for the aggregator from every heartbeat, for the
        others from the aggregator's summary (theirs as the aggregator saw it, a round ago at most)."""
        if self.process_id == AGGREGATOR:
            return {p: v for p, v in self._everyone().items() if v in ENDED}
        summary = _parse_summary(self.call(_try_get, self.client, SUMMARY_KEY, timeout_s=2.0))
        return dict(summary.states) if summary is not None else {}

    def _judge(self, seen: dict[int, progress.Seen | None], quiet_s: float) -> str | None:
        """The stall verdict (JSON) when some process waits for its peers and no process has ticked for longer
        than the group's bound; else None. Only while every process runs (an ended one is the exit hooks' case)."""
        if any(s is None for s in seen.values()):
            return None
        running: dict[int, progress.Seen] = {p: s for p, s in seen.items() if s is not None}
        if not any(s.waiting for s in running.values()):
            return None  # nobody waits for anybody: long work of the script's own is not a stall
        bound = progress.group_bound(running, progress.PROGRESS.settings.ceiling_s)
        if quiet_s <= bound:
            return None
        import json

        return json.dumps(
            {
                "detector": self.process_id,
                "quiet_s": round(quiet_s, 1),
                "bound_s": round(bound, 1),
                "behind": progress.behind(running),
                "group": {str(p): s.describe() for p, s in sorted(running.items())},
            }
        )

    def _stalled(self, verdict_text: str, values: dict[int, str]) -> None:
        """The group stalled: write this process's flight record, say who is behind and where, exit 70."""
        import json

        self.state = STALLED
        try:
            verdict = json.loads(verdict_text)
        except ValueError:
            verdict = {"detector": "?", "quiet_s": 0, "bound_s": 0, "behind": [], "group": {}}
        behind = [int(p) for p in verdict.get("behind", [])]
        seen = {p: s for p, s in ((p, progress.Seen.parse(v)) for p, v in values.items()) if s is not None}
        own = progress.Seen.parse(progress.publish(0, self.waiting_since is not None))
        if own is not None:
            seen[self.process_id] = own
        reason = (
            f"the group stalled: no process made progress for {verdict['quiet_s']:g} s (bound {verdict['bound_s']:g} "
            f"s, learned from the step times), seen by process {verdict['detector']}"
        )
        where = progress.stalled_frame()
        path = progress.write_flight_record(
            self.process_id, f"{reason}; this process is at {where}", seen, verdict.get("group", {})
        )
        with contextlib.suppress(Exception):
            key = f"{WHERE_PREFIX}{self.process_id}"
            self.call(self.client.key_value_set, key, where, allow_overwrite=True, timeout_s=2.0)
        with contextlib.suppress(Exception):
            self.call(self.client.key_value_set, self.key, _value(STALLED), allow_overwrite=True, timeout_s=2.0)
        # Wait briefly until every process has written its record and said where it is (their watchdogs see the
        # verdict within a round): an early exit would break the others' collectives before they have.
        places: dict[int, str] = {}
        peers = set(range(self.num_processes)) - {self.process_id}
        deadline = time.monotonic() + 3 * self.interval + 1.0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                for p in behind:
                    if p not in places:
                        place = self.call(_try_get, self.client, f"{WHERE_PREFIX}{p}", timeout_s=2.0)
                        if place is not None:
                            places[p] = place
                if self.process_id == AGGREGATOR:  # its rounds have stopped: the others' summary comes from here
                    values = self._everyone()
                    self._publish_summary(values, [], None, stalled=True)
                states = self._states()
                if all(states.get(p) in ENDED for p in peers) and all(p in places for p in behind):
                    break
            time.sleep(self.interval / 4)
        group = verdict.get("group", {})
        who = "; ".join(
            f"process {p} ({group.get(str(p), 'state unknown')}) at {places.get(p, 'an unknown place')}" for p in behind
        )
        records = f"flight record {path}" if path is not None else "no flight record (see above)"
        self._fail(
            f"stopped: {reason}. Behind: {who}. This process: {where}; {records}",
            code=exitcodes.EXIT_STALLED,
            mark=STALLED,
        )

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
        _silence_output()
        handler = signal.getsignal(signal.SIGTERM)
        if callable(handler):  # a Checkpointer's preemption handler: every process saves the agreed step, exits 75
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self._end(f"lost its launcher (pid {self.launcher}, jddp launch): killed or crashed")

    def _stuck(
        self, found: progress.Mismatch, values: dict[int, str], calls: dict[int, progress.Calls], now: float
    ) -> bool:
        """Whether the processes of a call mismatch have all waited in it (or for their peers) for
        ``MISMATCH_S``: no call of theirs ends by itself then (a device collective waits forever)."""
        key = (found.seq, tuple(sorted(found.groups.items())))
        if key != self.mismatch_key:
            self.mismatch_key, self.mismatch_since = key, now
        involved = [p for ps in found.groups.values() for p in ps]
        if all(calls[p].names and calls[p].names[-1] in progress.TIMED_CALLS for p in involved):
            return False  # each ends by itself at its time limit, naming the processes that did not call it
        for ps in found.groups.values():
            for p in ps:
                if p == self.process_id:
                    waits = self.waiting_since is not None or progress.PROGRESS.call_depth > 0
                else:
                    seen = progress.Seen.parse(values.get(p))
                    waits = seen is None or seen.waiting or values.get(p) in ENDED
                if not waits:
                    self.mismatch_since = now
                    return False
        return now - self.mismatch_since >= max(MISMATCH_S, 3 * self.interval)

    def _mismatched(self, found: progress.Mismatch, reason: str | None) -> None:
        """A collective made by a subset of the processes: the ones that made it exit 1 (their script's error),
        the others 69, each naming the call and the processes that made it."""
        odd = self.process_id in found.culprits()
        then = f" (then: {reason})" if reason is not None else ""
        self._fail(
            f"stopped: {found.describe()}{then}",
            code=1 if odd else exitcodes.EXIT_PEER_LOST,
            mark=FAILED if odd else LOST,
            cause=found.describe(),
        )

    def _calls_clause(self, calls: dict[int, progress.Calls], values: dict[int, str]) -> str:
        """Where each process was among jddp's collective calls, for a message about a lost peer."""
        parts = []
        for p, c in sorted(calls.items()):
            who = "this process" if p == self.process_id else f"process {p}"
            parts.append(f"{who} {c.describe()}")
        return "as last published: " + ", ".join(parts) if parts else "no collective calls published"

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
        import json

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
        mark: str = LOST,
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
            self.call(self.client.key_value_set, self.key, _value(mark), allow_overwrite=True, timeout_s=2.0)
        if self.process_id == AGGREGATOR:  # the others read the aggregator's state from its summary
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
                values, _, _ = _entries(self.call(self.client.key_value_dir_get, ALIVE_PREFIX, timeout_s=2.0))
            except Exception:
                return
            if all(values.get(p) in ENDED for p in peers):
                time.sleep(self.interval)  # time for their exit to get past JAX's client
                return
            time.sleep(self.interval / 2)

    def mark(self, state: str) -> None:
        self.state = state
        with contextlib.suppress(Exception):
            self.call(self.client.key_value_set, self.key, _value(state), allow_overwrite=True, timeout_s=5.0)
        if self.process_id == AGGREGATOR:
            self._republish()


def group_healthy() -> bool:
    """False once this process is ending because the group failed (an unhandled exception here, a lost peer, a
    stall): then nothing at exit may wait for the peers. True alone and in a group that is well."""
    return _watchdog is None or _watchdog.state in (None, DONE)


@contextlib.contextmanager
def waiting():
    """Around a jddp call where the main thread waits for peers (a step's output, an agreement): while it lasts,
    a peer that ended early (DONE) is not waited for longer than the peer timeout. Nests; free outside a group."""
    watchdog = _watchdog
    if watchdog is None or watchdog.waiting_since is not None:
        yield
        return
    watchdog.waiting_since = time.monotonic()
    try:
        yield
    finally:
        watchdog.waiting_since = None


# Python's hook list for what must run at shutdown before non-daemon threads are joined and before
# concurrent.futures refuses new work (its own shutdown is one of them; newest first). A private name of the
# threading module since Python 3.9; where it is missing, atexit, which runs later.
at_shutdown = getattr(threading, "_register_atexit", atexit.register)


def _install_exit_hooks() -> None:
    previous_hook = sys.excepthook

    def excepthook(kind, value, traceback):
        watchdog = _watchdog
        if watchdog is not None and watchdog.state == STALLED and is_collective_failure(value):
            # A peer that stalled with this one exited first: its watchdog ends this process in a moment, and
            # the broken collective is a consequence, not news.
            time.sleep(watchdog.peer_timeout_s)
        previous_hook(kind, value, traceback)
        if watchdog is None or issubclass(kind, KeyboardInterrupt):
            return
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
        watchdog.mark(FAILED)

    sys.excepthook = excepthook
    atexit.register(_at_exit)
    # A failed process must not wait at exit for a non-daemon thread that waits for its peers (Orbax's commit of
    # an async save, at a barrier the peers that exited 69 never reach): Python joins those threads before the
    # atexit hooks run, so this exit path is among threading's own hooks, which run first.
    at_shutdown(_exit_if_failed)


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective that failed on a broken connection (a peer lost or cut off)."""
    # XLA surfaces a broken gloo connection as JaxRuntimeError or, from some call sites, ValueError.
    text = str(error)
    return any(marker in text for marker in ("Gloo", "Connection closed by peer", "Connection reset by peer"))


def _exit_if_failed() -> None:
    """Ended by an unhandled exception (marked FAILED): exit 1 now. Peers stop on the mark; waiting for them
    (at a barrier, or in a thread of Orbax's) would only delay the exit, or never end; process 0 waits until they
    have seen it, since its exit would abort them."""
    watchdog = _watchdog
    if watchdog is None or not watchdog.is_alive() or watchdog.state != FAILED:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if watchdog.process_id == 0:
        watchdog.linger(limit_s=watchdog.peer_timeout_s)
    os._exit(1)


def _at_exit() -> None:
    """Finished normally: wait for the others (the watchdog still guards us), then let JAX shut down."""
    watchdog = _watchdog
    if watchdog is None or not watchdog.is_alive():
        return
    _exit_if_failed()
    watchdog.mark(DONE)
    # Wait for every peer to finish, however long its remaining work takes: the watchdog (still running) ends
    # this process if a peer dies or fails meanwhile. Only then does JAX's own time-limited shutdown barrier run.
    peers = set(range(watchdog.num_processes)) - {watchdog.process_id}
    while watchdog.peers_gone is None:
        try:
            states = watchdog._states()
        except Exception:
            break  # the coordinator is gone: nothing left to wait for
        if watchdog.process_id != AGGREGATOR and time.monotonic() - watchdog.summary_change > watchdog.peer_timeout_s:
            break  # the aggregator's summary stopped (it ended, or is gone): nothing more will be learned from it
        if all(states.get(p) in ENDED for p in peers):
            if watchdog.process_id == AGGREGATOR:
                # the others wait for the same in the summary, and this watchdog's rounds stop below: the last
                # ends it saw must be published now, or those still waiting would wait for them forever
                with contextlib.suppress(Exception):
                    watchdog._publish_summary(watchdog._everyone(), [], None)
            break
        time.sleep(watchdog.interval)
    with contextlib.suppress(Exception):
        states = watchdog._states()
        lost = sorted(p for p in peers if states.get(p) == LOST)
        if lost:  # they stopped waiting for this process, which had ended: the run failed, whatever its exit code
            watchdog.note(early=True, reason=f"ended while process(es) {lost} still needed it; they stopped (69)")
    watchdog.stopped.set()
    watchdog.join(timeout=5)


def _arm_stack_dump(timeout_s: float) -> None:
    """``faulthandler.dump_traceback_later`` to the process's own stderr (``sys.__stderr__``: a replaced
    ``sys.stderr`` may have no file descriptor); nothing when there is none. It replaces any dump a user armed."""
    stream = sys.__stderr__
    try:
        if stream is not None:
            faulthandler.dump_traceback_later(timeout_s, exit=False, file=stream)
    except (ValueError, OSError, RuntimeError):  # a closed or fd-less stream: no stack dump, the watchdog goes on
        pass
