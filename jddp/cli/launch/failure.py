"""How an attempt failed and what the launcher says and returns for it: the first failure among the processes
(``first_failure``), the summary of how each ended (``summary``, quoting the notes and the other nodes' reports),
and the launcher's exit code (``exit_code``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from jddp import exitcodes
from jddp.cli import reports
from jddp.cli.launch import workers

PEER_LOST_WAIT_S = 5.0  # after a process exits 69, how long the others get to end by themselves


def first_failure(group: Sequence[workers.Worker]) -> workers.Worker | None:
    """Of the processes found failed in this round, a killed one is the likeliest cause, then one that failed
    by itself, then one the launcher had to stop (frozen or stuck), and one that lost a peer the least likely."""
    failed = [
        (w, w.code)
        for w in group
        if w.code is not None and w.code not in (0, exitcodes.EXIT_PREEMPTED) and not w.stopped_for_restart
    ]
    if not failed:
        return None
    first = min(failed, key=lambda wc: (exitcodes.is_peer_failure(wc[1]), wc[0].unresponsive, wc[1] >= 0))[0]
    if exitcodes.is_peer_failure(first.code or 0):
        # Only processes that lost a peer: the cause is one that ended normally (exit 0) while they still
        # needed it, e.g. a script that returned early. It waits at its exit for the others, so its own exit
        # can come after theirs: any exit 0 of the round counts.
        early = [w for w in group if w.code == 0]
        if early:
            return min(early, key=lambda w: w.ended or 0.0)
    return first


def early_exit(w: workers.Worker) -> str:
    """What the summary says of a process that exited 0 while its peers still needed it (the cause of their 69)."""
    at = time.strftime("%H:%M:%S", time.localtime(w.ended_at)) if w.ended_at is not None else "an unknown time"
    return (
        f"process {w.process_id} exited 0 at {at} while its peers still needed it: it returned early or called "
        "sys.exit(0) (a loop that ended, or a branch taken on this process only), and the others, waiting for it in "
        "a step, stopped (exit 69). Every process must run the same steps to the end; a run that failed on this "
        "is not finished"
    )


def summary(
    group: Sequence[workers.Worker],
    first_failed: workers.Worker | None,
    notes: dict[int, dict],
    elsewhere: Callable[[], list[reports.Report]],
) -> str:
    """How each process of ``group`` ended, the first failure (``elsewhere``: the other nodes' reports, when none
    failed here) and the causes the processes' ``notes`` name."""

    def describe(w: workers.Worker) -> str:
        if w.code is None:  # it outlived SIGKILL and the 30 s wait after it
            return "still running"
        if w is first_failed and w.code == 0:
            return "exited 0 while its peers still needed it (the cause, below)"
        if w.stopped_for_restart:
            return "stopped by the launcher for the restart (SIGKILL)"
        if w.unresponsive:
            how = exitcodes.describe(w.code)
            return f"did not end with the group (frozen or stuck), stopped by the launcher: {how}"
        return exitcodes.describe(w.code)

    lines = [f"process {w.process_id} (pid {w.popen.pid}): {describe(w)}" for w in group]
    if first_failed is not None and first_failed.code == exitcodes.EXIT_STALLED:
        lines.append(
            "the group stalled: each process's last line above names the process that was behind and where, "
            "and each wrote a flight record (jddp.runtime.progress)"
        )
    elif first_failed is not None and first_failed.code == 0:
        lines.append(f"first failure: {early_exit(first_failed)}")
    elif first_failed is not None:
        lines.append(f"first failure: process {first_failed.process_id}, {describe(first_failed)}")
    elif elsewhere():
        said = "; ".join(f"node {r.node}: {r.what}" for r in elsewhere())
        lines.append(f"first failure on another node ({said})")
    if first_failed is not None and first_failed.code == exitcodes.EXIT_PEER_LOST:
        said = notes.get(first_failed.process_id, {}).get("reason")
        if isinstance(said, str):  # whom it lost and why, in its own words (another node's process, maybe)
            lines.append(f"process {first_failed.process_id} said: {said}")
    causes: dict[str, list[int]] = {}
    for p, note in sorted(notes.items()):
        if isinstance(note.get("cause"), str):
            causes.setdefault(note["cause"], []).append(p)
    for cause, found_by in causes.items():
        lines.append(f"cause, as process(es) {found_by} found it: {cause}")
    return "\n  ".join(["summary:", *lines])


def exit_code(
    outcome: str,
    first_failed: workers.Worker | None,
    group: Sequence[workers.Worker],
    *,
    signal_received: int | None,
    max_restarts: int,
    summarize: Callable[[workers.Worker | None], str],
) -> tuple[int, str | None]:
    """The launcher's exit code after the last attempt ended with ``outcome``, and what it says first (or None)."""
    preempted = exitcodes.EXIT_PREEMPTED
    if outcome == "ok":
        return 0, None
    if outcome == "preempted":
        return preempted, f"the run stopped on preemption (exit {preempted}); run again to resume"
    if outcome == "signal":
        codes = {w.code for w in group}
        if codes <= {0, preempted}:
            return (preempted if preempted in codes else 0), None
        assert signal_received is not None  # run_once returns "signal" only once one arrived
        return 128 + signal_received, summarize(None)
    said = f"{summarize(first_failed)}\nno restart left (--max-restarts {max_restarts})"
    if first_failed is None:  # the group failed on another node, and this node's processes ended without fault
        return exitcodes.EXIT_PEER_LOST, said
    assert first_failed.code is not None  # first_failure picks among processes that exited
    code = first_failed.code
    if code == 0:
        # The cause ended normally, early (first_failure picks a process that exited 0 only when every failure
        # was a lost peer): the run failed all the same, with the code of the first peer it left (69).
        left = [w for w in group if w.code not in (None, 0, exitcodes.EXIT_PREEMPTED)]
        code = min(left, key=lambda w: w.ended or 0.0).code if left else exitcodes.EXIT_PEER_LOST
        assert code is not None
    return (128 - code if code < 0 else code), said
