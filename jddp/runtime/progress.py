"""This process's progress (step, phase), published with the watchdog's heartbeat, and its flight record.

A data-parallel group whose processes are all alive can still stop: one process
sleeps in its data loading, spins in a Python loop, or waits on a file system,
and every other one waits for it in the next collective. JAX says nothing (the
heartbeats go on); PyTorch ends such a group after a fixed timeout (10 min for
NCCL) and keeps a flight record of its collectives. jddp learns the bound from
the run itself and names the process that is behind.

Every jddp call that makes progress marks it here, at the cost of a few
attribute writes: ``DataParallel.step`` and ``eval_step`` (a *tick*, and the
step counter), the ``DataLoader`` (phase ``data``), ``Checkpointer`` saves and
restores (``checkpoint``), the first call of each compiled program
(``compile``). A hand-written loop that uses ``dp.step`` needs nothing more;
one that steps with its own code calls ``jddp.heartbeat(step)`` once per step,
and wraps a long phase of its own in ``with jddp.phase("name"):``.

The watchdog thread (``jddp.runtime.watchdog``) publishes this state with its
heartbeat, and every process's watchdog judges the whole group each round: the
group has **stalled** when some process waits for its peers (in a collective, a
step's output, an agreement) and no process has ticked for longer than the
group's bound. The bound is learned: ``factor`` times the slowest interval
between ticks among the last ``WINDOW`` ticks of any process, clamped to
``[floor_s, ceiling_s]``; while any process is in a phase without a learned
length (``setup`` before its first step, ``compile``, ``checkpoint``, or a
phase of the user's own), the ceiling applies. Defaults: factor 10, floor
60 s, ceiling 30 min; ``JDDP_STALL_FACTOR``, ``JDDP_STALL_FLOOR``,
``JDDP_STALL_CEILING`` (seconds) or ``configure`` change them, and
``JDDP_STALL=0`` turns the detector off.

The first watchdog to see a stall publishes its verdict; every process then
writes a **flight record** (``flight-process-<i>.txt`` in the flight
directory: ``$JDDP_FLIGHT_DIR``, else ``fit``'s ``log_dir``, else
``jddp-flight`` in the working directory) with its step, phase, the programs it
has completed and has in flight, every process's progress as it saw it, and
the Python stack of every thread; prints one line naming the process that is
behind (the lowest step; among equals, one that is not waiting for its peers)
and where it is; and exits with ``EXIT_STALLED`` (70).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path

from jddp import envvars, exitcodes, validate

WINDOW = 256  # recent tick intervals the bound is learned from
# Phases with a learned length: their time counts into tick intervals. Any other phase (setup, compile,
# checkpoint, one named by the user) may take any time up to the ceiling.
LEARNED = frozenset({"step", "eval", "data", "user"})
FLIGHT_FILE = "flight-process-{}.txt"


@dataclasses.dataclass
class Settings:
    """The stall detector's settings; see the module docstring."""

    enabled: bool = True
    factor: float = 10.0
    floor_s: float = 60.0
    ceiling_s: float = 1800.0
    flight_dir: str | None = None

    @classmethod
    def from_env(cls) -> Settings:
        """The settings of the ``JDDP_STALL*`` and ``JDDP_FLIGHT_DIR`` variables (parsed by ``jddp.envvars``).

        Raises:
          ValueError: naming a variable whose value is refused, and the accepted values.
        """
        settings = cls(
            enabled=envvars.get("JDDP_STALL"),
            factor=envvars.get("JDDP_STALL_FACTOR"),
            floor_s=envvars.get("JDDP_STALL_FLOOR"),
            ceiling_s=envvars.get("JDDP_STALL_CEILING"),
            flight_dir=envvars.get("JDDP_FLIGHT_DIR"),
        )
        settings.check()
        return settings

    def check(self) -> None:
        if not self.floor_s <= self.ceiling_s:
            raise ValueError(
                f"The stall bound's floor ({self.floor_s:g} s) is above its ceiling ({self.ceiling_s:g} s); "
                "set JDDP_STALL_FLOOR <= JDDP_STALL_CEILING."
            )


class Progress:
    """This process's progress, written by the main thread, read by the watchdog thread (no lock: each write is
    one attribute, and the reader only needs a recent value)."""

    def __init__(self) -> None:
        self.step = 0  # steps dispatched: the step this process works on next
        self.phase = "setup"
        self.since = time.monotonic()  # when the phase began
        self.ticks = 0
        self.last_tick: float | None = None
        self.intervals: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.programs = 0  # compiled-program calls completed (their outputs waited for)
        self.last_done = "none"  # the last of them (those in flight: dispatch.DISPATCHER.in_flight())
        self.settings = Settings()

    def tick(self, step: int | None = None) -> None:
        now = time.monotonic()
        if self.last_tick is not None and self.phase in LEARNED:
            self.intervals.append(now - self.last_tick)
        self.last_tick = now
        self.ticks += 1
        if step is not None:
            self.step = step

    def bound(self) -> float:
        """This process's learned bound (the ceiling until it has ticked twice in learned phases)."""
        s = self.settings
        if not self.intervals:
            return s.ceiling_s
        return min(max(s.factor * max(self.intervals), s.floor_s), s.ceiling_s)

    def learned(self) -> bool:
        return self.phase in LEARNED and bool(self.intervals)


PROGRESS = Progress()


def configure(
    *,
    enabled: bool | None = None,
    factor: float | None = None,
    floor_s: float | None = None,
    ceiling_s: float | None = None,
    flight_dir: str | os.PathLike | None = None,
) -> Settings:
    """Changes the stall detector's settings in this process (call it on every process); returns them."""
    s = PROGRESS.settings
    new = dataclasses.replace(
        s,
        enabled=s.enabled if enabled is None else bool(enabled),
        factor=s.factor if factor is None else float(factor),
        floor_s=s.floor_s if floor_s is None else float(floor_s),
        ceiling_s=s.ceiling_s if ceiling_s is None else float(ceiling_s),
        flight_dir=s.flight_dir if flight_dir is None else os.fspath(flight_dir),
    )
    for name in ("factor", "floor_s", "ceiling_s"):
        if not getattr(new, name) > 0:
            raise ValueError(f"`{name}={getattr(new, name)!r}` must be positive.")
    new.check()
    PROGRESS.settings = new
    return new


def heartbeat(step: int | None = None) -> None:
    """Marks one unit of progress (a step) for the stall detector; ``step``: the step this process works on next.

    ``DataParallel.step`` does this itself; call it once per step in a loop that steps with its own code.
    """
    validate.check_int("step", step, minimum=0, optional=True)
    PROGRESS.tick(step)


def set_step(step: int) -> None:
    """The step this process works on next (after a restore); ticks nothing."""
    PROGRESS.step = int(step)


class phase:  # lower case: used like a function, `with jddp.phase("export"):`
    """This process is in phase ``name`` while the block runs (then back in the phase it was in).

    jddp's own calls mark theirs; wrap a long phase of a script's own (an evaluation of its own, a slow
    export) so the stall detector gives it up to the ceiling instead of the bound learned from steps.
    A class, not a generator: ``dp.step`` enters one per step.
    """

    __slots__ = ("name", "previous", "since")

    def __init__(self, name: str):
        validate.check_str("name", name)
        self.name = name

    def __enter__(self) -> None:
        p = PROGRESS
        self.previous, self.since = p.phase, p.since
        p.phase, p.since = self.name, time.monotonic()

    def __exit__(self, *exc) -> None:
        p = PROGRESS
        if self.previous == "setup" and p.ticks:  # the first step is done: between jddp calls is the script's own
            p.phase, p.since = "user", time.monotonic()
        else:
            p.phase, p.since = self.previous, self.since


# ----------------------------------------------------------------------------------------- the published value


def publish(counter: int, waiting: bool) -> str:
    """The watchdog's heartbeat value: ``counter;step;ticks;waiting;bound;learned;phase;phase_age``."""
    p = PROGRESS
    phase_name = p.phase.replace(";", ",")
    age = time.monotonic() - p.since
    return f"{counter};{p.step};{p.ticks};{int(waiting)};{p.bound():.3f};{int(p.learned())};{phase_name};{age:.1f}"


@dataclasses.dataclass(frozen=True)
class Seen:
    """A peer's progress as published (``publish``)."""

    step: int
    ticks: int
    waiting: bool
    bound: float
    learned: bool
    phase: str
    phase_age: float

    @classmethod
    def parse(cls, value: str | None) -> Seen | None:
        if value is None or ";" not in value:
            return None  # DONE, FAILED, LOST, or not published yet
        try:
            _, step, ticks, waiting, bound, learned, phase_name, age = value.split(";", 7)
            return cls(int(step), int(ticks), waiting == "1", float(bound), learned == "1", phase_name, float(age))
        except ValueError:
            return None

    def describe(self) -> str:
        phase_text = f"phase {self.phase} for {self.phase_age:.0f} s"
        return f"step {self.step}, " + (f"waiting for its peers ({phase_text})" if self.waiting else phase_text)


def group_bound(seen: dict[int, Seen], ceiling_s: float) -> float:
    """The group's bound: the largest learned bound, or the ceiling while any process is in an unlearned phase."""
    if not seen or not all(s.learned for s in seen.values()):
        return ceiling_s
    return max(s.bound for s in seen.values())


def behind(seen: dict[int, Seen]) -> list[int]:
    """The processes that are behind: the lowest step, and among those the ones not waiting for their peers
    (all of them when every one waits)."""
    low = min(s.step for s in seen.values())
    at_low = [p for p, s in sorted(seen.items()) if s.step == low]
    working = [p for p in at_low if not seen[p].waiting]
    return working or at_low


# ------------------------------------------------------------------------------------------- the flight record


def flight_dir() -> Path:
    return Path(PROGRESS.settings.flight_dir or "jddp-flight")


def write_flight_record(
    process_id: int, reason: str, seen: dict[int, Seen], verdict_view: dict[str, str] | None = None
) -> Path | None:
    """Writes this process's flight record (atomically); returns its path, or None if it could not be written."""
    from jddp.runtime import dispatch  # imports this module: here, not at the top

    p = PROGRESS
    pending = dispatch.DISPATCHER.in_flight()
    lines = [
        f"jddp flight record: process {process_id}, {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
        f"reason: {reason}",
        "",
        f"step {p.step} (steps dispatched), phase {p.phase} for {time.monotonic() - p.since:.1f} s, {p.ticks} ticks",
        f"learned bound {p.bound():.1f} s from {len(p.intervals)} tick intervals{_interval_stats(p)}",
        f"compiled programs completed: {p.programs}, the last: {p.last_done}",
        f"in flight (dispatched, not yet waited for): {', '.join(pending) or 'none'}",
        "",
        "the group when the stall was judged (by the process that judged it):",
        *(f"  process {q}: {text}" for q, text in sorted((verdict_view or {}).items(), key=lambda kv: int(kv[0]))),
        "the group as this process saw it then (processes that had ended or stopped are left out):",
        *(f"  process {q}: {s.describe()}" for q, s in sorted(seen.items())),
        "",
        "Python stacks:",
    ]
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is None:
            continue
        main = " (main)" if thread is threading.main_thread() else ""
        lines.append(f"--- thread {thread.name}{main}, most recent call last:")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    text = "\n".join(lines) + "\n"
    directory = flight_dir()
    path = directory / FLIGHT_FILE.format(process_id)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as error:
        os.write(2, f"jddp: could not write the flight record {path}: {error}\n{text}".encode())
        return None
    return path


def _interval_stats(p: Progress) -> str:
    if not p.intervals:
        return ""
    ordered = sorted(p.intervals)
    return f" (median {ordered[len(ordered) // 2]:.4f} s, max {ordered[-1]:.4f} s)"


def _library(filename: str) -> bool:
    """A frame of Python's standard library, an installed package or jddp: not where a script is stuck."""
    roots = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return filename.startswith(tuple(roots)) or f"{os.sep}jddp{os.sep}" in filename or filename.startswith("<")


def stalled_frame() -> str:
    """Where this process is stuck: ``file:line in function``, the innermost frame of the script's own code in
    the thread where that frame is closest to the top of the stack (a transform sleeping in a prefetch thread
    rather than the main thread's call of ``fit``); the main thread wins ties. jddp's own threads are left out."""
    frames = sys._current_frames()
    best: tuple[int, int, str] | None = None
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is None or thread.name.startswith("jddp-"):
            continue
        stack = traceback.extract_stack(frame)
        own = [i for i, f in enumerate(stack) if not _library(f.filename)]
        if not own:
            continue
        f = stack[own[-1]]
        main = thread is threading.main_thread()
        key = (len(stack) - 1 - own[-1], 0 if main else 1)
        where = f"{f.filename}:{f.lineno} in {f.name}" + ("" if main else f" (thread {thread.name})")
        if best is None or key < best[:2]:
            best = (*key, where)
    return best[2] if best is not None else "an unknown place (no frame of the script's own code)"


EXIT_STALLED = exitcodes.EXIT_STALLED
