"""What the watchdogs keep in the coordination service's key-value store, and how they read it back.

Each watchdog (``jddp.runtime.watchdog``) writes its heartbeat under ``jddp/alive/<process>``: its round counter
and progress while it runs (``jddp.runtime.progress.publish``), or how it ended (``DONE``, ``FAILED``, ``LOST``,
``STALLED``), then ``|`` and its collective calls (``progress.calls_text``). The aggregator's watchdog (process
``AGGREGATOR``) reads every heartbeat and publishes what it found as one small ``Summary`` under ``SUMMARY_KEY``;
the first watchdog that sees the group stalled sets the verdict under ``STALL_KEY``.
"""

from __future__ import annotations

import dataclasses
import json

from jddp.runtime import progress

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
                "states": {v: runs(sorted(p for p, w in self.states.items() if w == v)) for v in ENDED},
                "silent": self.silent,
                "mismatch": None if found is None else {"seq": found.seq, "groups": found.groups, "odd": found.odd},
                "stalled": self.stalled,
            },
            separators=(",", ":"),
        )


def parse_summary(text: str | None) -> Summary | None:
    """The summary ``Summary.text`` wrote, or None (not published yet)."""
    if text is None:
        return None
    d = json.loads(text)
    m = d["mismatch"]
    found = None if m is None else progress.Mismatch(m["seq"], {k: tuple(v) for k, v in m["groups"].items()}, m["odd"])
    states = {p: v for v, runs in d["states"].items() for first, last in runs for p in range(first, last + 1)}
    return Summary(d["round"], states, list(d["silent"]), found, d["stalled"])


def runs(processes: list[int]) -> list[list[int]]:
    """Sorted process indices as runs ``[first, last]``: the ends of a whole group of 1024 are one run, a few
    bytes, for every watchdog that reads them."""
    runs: list[list[int]] = []
    for p in processes:
        if runs and runs[-1][1] == p - 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return runs


def try_get(client, key: str) -> str | None:
    """The value of ``key`` in the coordination service's store, or None when it has none."""
    try:
        return client.key_value_try_get(key)
    except Exception as error:
        if "NOT_FOUND" in str(error):
            return None
        raise


def entries(entries) -> tuple[dict[int, str], str | None, dict[int, progress.Calls]]:
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


def value(state: str) -> str:
    """A heartbeat value: the state (or progress), then this process's collective calls."""
    return f"{state}|{progress.calls_text()}"
