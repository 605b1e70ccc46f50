"""This process's progress (step, phase) and its jddp collective calls, published with the watchdog's heartbeat.

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
writes a **flight record** (``jddp.runtime.flight``: ``flight-process-<i>.txt`` in the flight
directory: ``$JDDP_FLIGHT_DIR``, else ``fit``'s ``log_dir``, else
``jddp-flight`` in the working directory) with its step, phase, the programs it
has completed and has in flight, every process's progress as it saw it, and
the Python stack of every thread; prints one line naming the process that is
behind (the lowest step; among equals, one that is not waiting for its peers)
and where it is; and exits with ``EXIT_STALLED`` (70).

Collective calls: every jddp call that every process of a group must make is
declared with ``collective_call`` (``DataParallel.step``, ``Checkpointer.save``,
``jddp.barrier``, the host collectives, ...; ``COLLECTIVE_CALLS`` lists them) and
numbers itself as it begins. The watchdog publishes the number and the last
names with the heartbeat; ``mismatch`` finds processes that made different calls
at one number (a call made by a subset of the processes) and names the call and
the processes that made it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from collections.abc import Callable

from jddp import envvars, exitcodes, validate

WINDOW = 256  # recent tick intervals the bound is learned from
# Phases with a learned length: their time counts into tick intervals. Any other phase (setup, compile,
# checkpoint, one named by the user) may take any time up to the ceiling.
LEARNED = frozenset({"step", "eval", "data", "user"})
CALL_HISTORY = 8  # names of the last collective calls published with the heartbeat
COLLECTIVE_CALLS: list[str] = []  # every name given to ``collective_call``, in the order the modules declared them
TIMED_CALLS: set[str] = set()  # the calls with a time limit of their own, whose error names the missing processes
ANNOUNCE: Callable[[], None] | None = None  # set by the watchdog in a group: publishes this process's calls now


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
        # jddp's collective calls (``collective_call``): how many began, how deep the current one is nested, and
        # the names of the last CALL_HISTORY (the last is call number ``call_seq``'s).
        self.call_seq = 0
        self.call_depth = 0
        self.call_names: collections.deque[str] = collections.deque(maxlen=CALL_HISTORY)

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


# ------------------------------------------------------------------------------------------ collective calls


class collective_call:  # lower case: a decorator
    """Marks a jddp call that every process of a group must make (``@collective_call("Checkpointer.save")``).

    Each call numbers itself (the ``n``-th collective call of this process; a call made inside another counts
    as the outer one) at the cost of a few attribute writes; the watchdog publishes the numbers and names with
    its heartbeat (``calls_text``), so that a call made by a subset of the processes is named with the processes
    that made it (``mismatch``) instead of ending in gloo's "Received data size doesn't match" or a hang.
    """

    __slots__ = ("eager", "name")

    def __init__(self, name: str, *, eager: bool = True, timed: bool = False):
        self.name = name
        self.eager = eager  # publish at once (``ANNOUNCE``): calls made once in a while, not every step
        if name not in COLLECTIVE_CALLS:
            COLLECTIVE_CALLS.append(name)
        if timed:  # ends by itself after its ``timeout_s``, naming the processes that did not call it
            TIMED_CALLS.add(name)

    def __enter__(self) -> None:
        p = PROGRESS
        if not p.call_depth:
            p.call_seq += 1
            p.call_names.append(self.name)
            if self.eager and ANNOUNCE is not None:
                # Before the call's collectives: gloo may abort this process from C++ the moment a peer's data
                # does not match, before the watchdog's next round would have published the call.
                ANNOUNCE()
        p.call_depth += 1

    def __exit__(self, *exc) -> None:
        PROGRESS.call_depth -= 1

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)

        return wrapper


def calls_text() -> str:
    """This process's collective calls as published: ``seq:inside:name,name,...`` (the last name is call
    ``seq``'s)."""
    p = PROGRESS
    return f"{p.call_seq}:{int(p.call_depth > 0)}:{','.join(p.call_names)}"


@dataclasses.dataclass(frozen=True)
class Calls:
    """A process's collective calls as published (``calls_text``)."""

    seq: int
    inside: bool
    names: tuple[str, ...]

    @classmethod
    def parse(cls, text: str | None) -> Calls | None:
        try:
            seq, inside, names = (text or "").split(":", 2)
            return cls(int(seq), inside == "1", tuple(n for n in names.split(",") if n))
        except ValueError:
            return None

    def name_at(self, seq: int) -> str | None:
        """The name of call number ``seq``, if it is among the last ``CALL_HISTORY``."""
        back = self.seq - seq
        if seq < 1 or not 0 <= back < len(self.names):
            return None
        return self.names[-1 - back]

    def describe(self) -> str:
        if not self.seq:
            return "no jddp collective call yet"
        last = self.names[-1] if self.names else "?"
        return (
            f"in {last} (its collective call #{self.seq})"
            if self.inside
            else (f"outside jddp's collective calls (the last: {last}, #{self.seq})")
        )


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """Processes that made different jddp collective calls as their call number ``seq``."""

    seq: int
    groups: dict[str, tuple[int, ...]]  # call name -> the processes that made it
    odd: str  # the name of the call made by the fewest processes (that broke its processes' routine)

    def culprits(self) -> tuple[int, ...]:
        return self.groups[self.odd]

    def describe(self) -> str:
        def who(ps: tuple[int, ...]) -> str:
            return f"process {ps[0]}" if len(ps) == 1 else f"processes {list(ps)}"

        odd = self.culprits()
        alone = "alone" if len(odd) == 1 else "without the others"
        others = "; ".join(
            f"{who(ps)} {'was' if len(ps) == 1 else 'were'} in {name} (call #{self.seq} there)"
            for name, ps in sorted(self.groups.items(), key=lambda kv: kv[1])
            if name != self.odd
        )
        return (
            f"{who(odd)} called {self.odd} {alone} (jddp collective call #{self.seq}); {others}. Every process must "
            "make the same jddp collective calls in the same order: a call under `if jax.process_index() == 0:` is "
            "made by process 0 alone (call it on every process; jddp's saves and checks already write once)"
        )


def mismatch(calls: dict[int, Calls]) -> Mismatch | None:
    """The processes' different calls at the lowest call number any of them has reached, or None when they agree
    there (a process ahead has made the same call before moving on)."""
    if len(calls) < 2:
        return None
    seq = min(c.seq for c in calls.values())
    if seq < 1:
        return None
    groups: dict[str, list[int]] = {}
    for p, c in sorted(calls.items()):
        name = c.name_at(seq)
        if name is not None:
            groups.setdefault(name, []).append(p)
    if len(groups) < 2:
        return None

    def oddness(item: tuple[str, list[int]]) -> tuple[int, int, str]:
        name, ps = item
        routine = all(calls[p].name_at(seq - 1) == name for p in ps)  # the same call as each one's call before
        return len(ps), int(routine), name

    odd = min(groups.items(), key=oddness)[0]
    return Mismatch(seq, {name: tuple(ps) for name, ps in groups.items()}, odd)


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


EXIT_STALLED = exitcodes.EXIT_STALLED
