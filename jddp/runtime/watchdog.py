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

Collective calls: the heartbeat value also carries this process's jddp collective
calls (``progress.collective_call``: the number of the current one and the names of
the last few). When the processes made different calls at one number (a
``Checkpointer.save`` under ``if jax.process_index() == 0:`` against the others'
``DataParallel.step``) and every one of them has waited ``MISMATCH_S`` in its call,
or a peer failed meanwhile, each stops naming the call and the processes that made
it: those exit 1, the others 69. A message about a lost peer says where each process
was among these calls. Under ``jddp launch`` each process leaves its launcher a note
as it stops (``GroupLink.note``): the peers it found silent, which the launcher then SIGKILLs
at once, the cause it found, or an early end.

The exit hooks (``jddp.runtime.exit_hooks``): ``sys.excepthook`` marks this process FAILED, and an ``atexit`` hook
marks it DONE and waits for every peer to finish. The launcher's loss: ``jddp.runtime.group_link``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import sys
import time

from jddp import exitcodes
from jddp.runtime import exit_hooks, flight, group_link, heartbeats, jax_internals, peer_wait, progress

# How long the processes of a collective call mismatch (``progress.mismatch``) must all wait in it before they
# stop: a host collective of two kinds at one place raises by itself in far less (``jddp.runtime.host``).
MISMATCH_S = 3.0

# Kept importable here, where the rest of jddp and the benchmarks (benchmarks/control_plane.py) read them.
MAX_ROUND_S = group_link.MAX_ROUND_S
ALIVE_PREFIX = heartbeats.ALIVE_PREFIX
AGGREGATOR = heartbeats.AGGREGATOR
SUMMARY_KEY = heartbeats.SUMMARY_KEY
LOST = heartbeats.LOST
Summary = heartbeats.Summary
_value = heartbeats.value
_entries = heartbeats.entries
_try_get = heartbeats.try_get
_parse_summary = heartbeats.parse_summary
waiting = peer_wait.waiting
group_healthy = peer_wait.group_healthy
at_shutdown = exit_hooks.at_shutdown
is_collective_failure = exit_hooks.is_collective_failure


def start(client, process_id: int, num_processes: int, coordinator: str | None, peer_timeout_s: float) -> Watchdog:
    """Starts this process's watchdog and installs the exit hooks (once per process)."""
    watchdog = peer_wait.WATCHDOG = Watchdog(client, process_id, num_processes, coordinator, peer_timeout_s)
    watchdog.start()
    exit_hooks.install()
    progress.ANNOUNCE = watchdog.announce
    # A process that gloo aborts from C++ (a collective made by a subset of the processes: "Received data size
    # doesn't match") prints where its Python threads were, the script's call among them.
    with contextlib.suppress(ValueError, OSError, RuntimeError, AttributeError):
        if sys.__stderr__ is not None and not faulthandler.is_enabled():
            faulthandler.enable(file=sys.__stderr__)
    return watchdog


def _silent_reason(silent: list[int], peer_timeout_s: float) -> str:
    return f"lost process(es) {silent}: no sign of life for more than {peer_timeout_s:g} s (killed, crashed or frozen)"


class Watchdog(group_link.GroupLink):
    """Ends this process when a peer is lost; see the module docstring."""

    def __init__(self, client, process_id: int, num_processes: int, coordinator: str | None, peer_timeout_s: float):
        super().__init__(client, process_id, num_processes, coordinator, peer_timeout_s)
        self.mismatch_key: object = None  # the call mismatch seen (``_stuck``), and since when
        self.mismatch_since = 0.0

    def announce(self) -> None:
        """Publishes this process's heartbeat value now, with its collective calls (from the main thread, as a
        collective call begins: ``progress.collective_call``); gives up after a second."""
        if self.state is not None or self.stopped.is_set():
            return
        value = heartbeats.value(progress.publish(self.counter, self.waiting_since is not None))
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
        aggregating = self.process_id == heartbeats.AGGREGATOR
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
                value = heartbeats.value(self.state or progress.publish(self.counter, self.waiting_since is not None))
                self.call(self.client.key_value_set, self.key, value, allow_overwrite=True)
                if aggregating:
                    entries = self.call(self.client.key_value_dir_get, heartbeats.ALIVE_PREFIX)
                else:
                    summary = heartbeats.parse_summary(
                        self.call(heartbeats.try_get, self.client, heartbeats.SUMMARY_KEY)
                    )
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
            values, verdict, calls = heartbeats.entries(entries)
            calls[self.process_id] = progress.Calls.parse(progress.calls_text())  # type: ignore[assignment]
            if verdict is not None and self.state is None:
                self._publish_summary(values, [], None, stalled=True)
                self._stalled(verdict, values)
                return
            reason = None
            for p in peers:
                value = values.get(p)
                if value == heartbeats.FAILED:
                    reason = f"process {p} ended with an unhandled exception (see its output)"
                elif value == heartbeats.LOST:
                    reason = f"process {p} lost a peer and ended (exit {exitcodes.EXIT_PEER_LOST})"
                if value != last_value[p] or starved or value == heartbeats.DONE:
                    last_value[p], last_change[p] = value, now
            silent = [p for p in peers if now - last_change[p] > self.peer_timeout_s]
            if silent:
                reason = _silent_reason(silent, self.peer_timeout_s)
            found = progress.mismatch({p: c for p, c in calls.items() if values.get(p) != heartbeats.DONE})
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
                        self.call(self.client.key_value_set, heartbeats.STALL_KEY, verdict, allow_overwrite=True)
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
        ended = [p for p in peers if values.get(p) == heartbeats.DONE]
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

    def _follow(self, summary: heartbeats.Summary | None, stale_s: float, peers: list[int]) -> bool:
        """A round of a watchdog other than the aggregator's: acts on the aggregator's ``summary`` (what it found
        of every process), or names the aggregator lost when its summary has not moved for ``peer_timeout_s``
        (``stale_s``); True when this process stopped."""
        values = dict(summary.states) if summary is not None else {}
        silent = [p for p in (summary.silent if summary is not None else []) if p != self.process_id]
        if stale_s > self.peer_timeout_s and values.get(heartbeats.AGGREGATOR) not in heartbeats.ENDED:
            silent = sorted({*silent, heartbeats.AGGREGATOR})
        if summary is not None and summary.stalled and self.state is None and not silent:
            with contextlib.suppress(Exception):
                verdict = self.call(heartbeats.try_get, self.client, heartbeats.STALL_KEY, timeout_s=2.0)
                if verdict is not None:
                    self._stalled(verdict, self._everyone())
                    return True
        reason = None
        for p in peers:
            if values.get(p) == heartbeats.FAILED:
                reason = f"process {p} ended with an unhandled exception (see its output)"
            elif values.get(p) == heartbeats.LOST:
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
                everyone, _, calls = heartbeats.entries(
                    self.call(self.client.key_value_dir_get, heartbeats.ALIVE_PREFIX, timeout_s=2.0)
                )
                values = {**everyone, **values}
            calls[self.process_id] = progress.Calls.parse(progress.calls_text())  # type: ignore[assignment]
            # A call made apart, seen in that read: named as the aggregator would have (it may be what gloo aborted
            # for that call: then nobody else judges it)
            found = progress.mismatch({p: c for p, c in calls.items() if values.get(p) != heartbeats.DONE})
            if found is not None:
                self._mismatched(found, reason)
                return True
        return self._act(reason, values, calls, peers, silent, time.monotonic())

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
        self.state = heartbeats.STALLED
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
        where = flight.stalled_frame()
        path = flight.write_flight_record(
            self.process_id, f"{reason}; this process is at {where}", seen, verdict.get("group", {})
        )
        with contextlib.suppress(Exception):
            key = f"{heartbeats.WHERE_PREFIX}{self.process_id}"
            self.call(self.client.key_value_set, key, where, allow_overwrite=True, timeout_s=2.0)
        with contextlib.suppress(Exception):
            self.call(
                self.client.key_value_set,
                self.key,
                heartbeats.value(heartbeats.STALLED),
                allow_overwrite=True,
                timeout_s=2.0,
            )
        # Wait briefly until every process has written its record and said where it is (their watchdogs see the
        # verdict within a round): an early exit would break the others' collectives before they have.
        places: dict[int, str] = {}
        peers = set(range(self.num_processes)) - {self.process_id}
        deadline = time.monotonic() + 3 * self.interval + 1.0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                for p in behind:
                    if p not in places:
                        place = self.call(
                            heartbeats.try_get, self.client, f"{heartbeats.WHERE_PREFIX}{p}", timeout_s=2.0
                        )
                        if place is not None:
                            places[p] = place
                if (
                    self.process_id == heartbeats.AGGREGATOR
                ):  # its rounds have stopped: the others' summary comes from here
                    values = self._everyone()
                    self._publish_summary(values, [], None, stalled=True)
                states = self._states()
                if all(states.get(p) in heartbeats.ENDED for p in peers) and all(p in places for p in behind):
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
            mark=heartbeats.STALLED,
        )

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
                    waits = seen is None or seen.waiting or values.get(p) in heartbeats.ENDED
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
            mark=heartbeats.FAILED if odd else heartbeats.LOST,
            cause=found.describe(),
        )

    def _calls_clause(self, calls: dict[int, progress.Calls], values: dict[int, str]) -> str:
        """Where each process was among jddp's collective calls, for a message about a lost peer."""
        parts = []
        for p, c in sorted(calls.items()):
            who = "this process" if p == self.process_id else f"process {p}"
            parts.append(f"{who} {c.describe()}")
        return "as last published: " + ", ".join(parts) if parts else "no collective calls published"


def _arm_stack_dump(timeout_s: float) -> None:
    """``faulthandler.dump_traceback_later`` to the process's own stderr (``sys.__stderr__``: a replaced
    ``sys.stderr`` may have no file descriptor); nothing when there is none. It replaces any dump a user armed."""
    stream = sys.__stderr__
    try:
        if stream is not None:
            faulthandler.dump_traceback_later(timeout_s, exit=False, file=stream)
    except (ValueError, OSError, RuntimeError):  # a closed or fd-less stream: no stack dump, the watchdog goes on
        pass
