"""Goodput accounts: an attempt's parts of wall time from its ledger's values, and a run's ``Total`` of them.

Pure arithmetic on the values of ``jddp.goodput_ledger.read`` (or of ``goodput`` records): no files. What the parts
are, and the rule that each instant of a run's span is counted once, are ``jddp.goodput``'s module docstring.
"""

from __future__ import annotations

import dataclasses
import math

TIMERS = ("restore_s", "compile_s", "step_s", "data_wait_s", "checkpoint_s", "eval_s")  # fit's own timers
# An attempt's account: its parts add up to its span (jddp.goodput); the teardown comes after the span.
PARTS = ("startup_s", *TIMERS, "other_s", "recomputed_s", "lost_s", "downtime_s")
TEARDOWN = "teardown_s"
# Where an overlap with the next attempt, or timers beyond the wall time, are taken from first (jddp.goodput).
CUT_FIRST = ("lost_s", "other_s", "startup_s")


def _floor6(seconds: float) -> float:
    """``seconds`` to the microsecond below."""
    return math.floor(seconds * 1e6) / 1e6


def _fit_into(parts: dict[str, float], span: float) -> dict[str, float]:
    """``parts`` (each >= 0, summing to at least ``span``) cut down to sum to ``span``: from ``CUT_FIRST`` in that
    order, then all of them in proportion."""
    excess = sum(parts.values()) - span
    for name in CUT_FIRST:
        if excess <= 0:
            break
        taken = min(parts[name], excess)
        parts[name] -= taken
        excess -= taken
    total = sum(parts.values())
    if excess > 0 and total > 0:
        parts = {k: v * span / total for k, v in parts.items()}
    return parts


def account(
    ledger: dict[str, float],
    index: int,
    *,
    next_start: float | None,
    next_first_step: int | None,
    end: float | None = None,
    not_before: float | None = None,
) -> dict[str, float]:
    """One attempt's parts (see ``jddp.goodput``'s module docstring) from its ledger.

    Args:
      ledger: ``jddp.goodput_ledger.read(path)``.
      index: the attempt's number (0 first).
      next_start, next_first_step: the next attempt's start and restored step (None for the last attempt).
      end: when the attempt ended, if known from outside (the launcher's ``JDDP_PREVIOUS_END``); else its own end
        for a finished attempt, or its last step for one that was stopped.
      not_before: where the previous attempt's account ended (its end plus its downtime): this one starts there
        at the earliest, so that no instant is counted twice.

    Returns:
      ``attempt``, ``start`` and ``end`` (the span, teardown excluded), the ``PARTS`` (summing to
      ``end - start + downtime_s``), ``teardown_s`` (last attempt only), ``recomputed_steps``, ``steps``,
      ``first_step``, ``last_step`` and ``finished``.
    """
    timers = {k: max(0.0, ledger[k]) if math.isfinite(ledger[k]) else 0.0 for k in TIMERS}
    measured = sum(timers.values())
    finished = ledger["end"] > 0
    last = ledger["end"] if finished else ledger["last_update"]
    if end is None or math.isnan(end) or end < last:
        end = last
    start = ledger["attempt_start"] if not_before is None else max(ledger["attempt_start"], not_before)
    steps_run = max(0, int(ledger["steps_run"]))
    redone = 0
    if next_first_step is not None:
        redone = max(0, min(int(ledger["last_step"]) - next_first_step, steps_run))
    busy = timers["step_s"] + timers["data_wait_s"]
    recomputed = redone * busy / steps_run if steps_run else 0.0
    if recomputed:
        share = timers["step_s"] / busy
        timers["step_s"] -= recomputed * share
        timers["data_wait_s"] -= recomputed * (1 - share)
    fit_start = max(ledger["fit_start"], start)
    within = max(0.0, last - fit_start)  # fit's time to its last step, which its timers divide
    scale = min(1.0, within / measured) if measured > 0 else 1.0  # timers past it (clocks): scaled down to it
    raw = {
        "startup_s": fit_start - start,
        **{k: v * scale for k, v in timers.items()},
        "other_s": within - measured * scale,
        "recomputed_s": recomputed * scale,
        "lost_s": max(0.0, end - max(last, start)),
    }  # sums to at least end - start (exactly, unless the last step came before fit's start)
    cut = end if next_start is None else min(end, next_start)
    span_end = max(start, cut)
    parts = _fit_into({k: max(0.0, v) for k, v in raw.items()}, span_end - start)
    parts["downtime_s"] = max(0.0, next_start - span_end) if next_start is not None else 0.0
    teardown = ledger["teardown_end"] - span_end if next_start is None and ledger["teardown_end"] > 0 else 0.0
    return {
        "attempt": float(index),
        "start": start,
        "end": span_end,
        **{k: _floor6(parts[k]) for k in PARTS},  # rounded down: the sum stays within the span
        TEARDOWN: _floor6(max(0.0, teardown)),
        "recomputed_steps": float(redone),
        "steps": float(steps_run),
        "first_step": ledger["first_step"],
        "last_step": ledger["last_step"],
        "finished": float(finished),
        "restored_from": ledger.get("restored_from", 0.0),
        "processes": ledger.get("processes", 1.0),
        "nodes": ledger.get("nodes", 0.0),
        "round": ledger.get("round", 0.0),
    }


def accounts(ledgers: list[dict[str, float]], indices: list[int] | None = None) -> list[dict[str, float]]:
    """The accounts of a run's attempts, in order (each with its successor's start, restored step and the
    launcher's end of it), each starting where the previous one's ends: the parts sum to the run's span."""
    indices = list(range(len(ledgers))) if indices is None else indices
    out: list[dict[str, float]] = []
    not_before = None
    for i, ledger in enumerate(ledgers):
        following = ledgers[i + 1] if i + 1 < len(ledgers) else None
        a = account(
            ledger,
            indices[i],
            next_start=following["attempt_start"] if following else None,
            next_first_step=int(following["first_step"]) if following else None,
            end=following["previous_end"] if following else None,
            not_before=not_before,
        )
        not_before = a["end"] + a["downtime_s"]
        out.append(a)
    return out


@dataclasses.dataclass(frozen=True)
class Total:
    """A run's account over its attempts: ``parts`` sum to ``wall_s``, the span from the run's start to the end
    of its last ``fit``; ``teardown_s`` came after it."""

    parts: dict[str, float]
    wall_s: float
    attempts: int
    recomputed_steps: int
    teardown_s: float = 0.0
    run: str = ""

    @classmethod
    def of(cls, records: list[dict], run: str = "") -> Total:
        records = sorted(records, key=lambda r: r["attempt"])
        parts = {k: float(sum(r.get(k, 0.0) for r in records)) for k in PARTS}
        wall = records[-1]["end"] - records[0]["start"] if records else 0.0
        teardown = float(records[-1].get(TEARDOWN, 0.0)) if records else 0.0
        steps = int(sum(r.get("recomputed_steps", 0) for r in records))
        return cls(parts, wall, len(records), steps, teardown, run)

    @property
    def goodput(self) -> float:
        return self.parts["step_s"] / self.wall_s if self.wall_s > 0 else 0.0

    def record(self) -> dict[str, float]:
        return {
            **{k: _floor6(v) for k, v in self.parts.items()},
            "wall_s": round(self.wall_s, 6),
            "goodput": round(self.goodput, 6),
            "attempts": float(self.attempts),
            "recomputed_steps": float(self.recomputed_steps),
        }

    def line(self) -> str:
        """The summary ``fit`` prints at its end and ``jddp goodput`` prints for the same span."""
        shown = ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in self.parts.items() if v >= 0.05)
        return (
            f"goodput of run {self.run}: {100 * self.goodput:.1f}% of {self.wall_s:.1f} s, from the run's start to "
            f"the end of its last fit, over {self.attempts} attempt(s) ({self.recomputed_steps} steps recomputed): "
            f"{shown}"
        )

    def table(self) -> str:
        rows = [f"{'part':<14}{'seconds':>10}{'share':>9}"]
        for k, v in self.parts.items():
            share = v / self.wall_s if self.wall_s > 0 else 0.0
            rows.append(f"{k[:-2]:<14}{v:>10.2f}{100 * share:>8.1f}%")
        accounted = sum(self.parts.values())
        rows.append(f"{'sum of parts':<14}{accounted:>10.2f}{100 * accounted / max(self.wall_s, 1e-9):>8.1f}%")
        rows.append(f"{'wall':<14}{self.wall_s:>10.2f}   (the run's start to the end of its last fit)")
        rows.append(
            f"goodput (step time / wall): {100 * self.goodput:.1f}%, attempts {self.attempts}, "
            f"steps recomputed {self.recomputed_steps}"
        )
        if self.teardown_s > 0:
            whole = self.wall_s + self.teardown_s
            rows.append(
                f"after the span, teardown (the script's end, the processes' exit, jddp launch's end): "
                f"{self.teardown_s:.2f} s; with it, goodput {100 * self.parts['step_s'] / whole:.1f}% of {whole:.2f} s"
            )
        return "\n".join(rows)
