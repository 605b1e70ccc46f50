"""Every ``JDDP_*`` environment variable jddp reads, and the one typed parser for them and for the numeric options
of the ``jddp`` commands. Imports nothing heavier than the standard library, so the launcher stays JAX-free.

``VARIABLES`` declares each variable: its type, its default, its allowed range and one line of meaning; those
marked ``internal`` are handshakes that ``jddp launch`` sets for its processes (set them by hand only to play the
launcher's part). ``get(name)`` reads one from the environment, ``parse(name, text)`` checks a value. The rules:

* unset, empty or only whitespace: the default;
* booleans: ``1/0``, ``true/false``, ``yes/no``, ``on/off`` in any case; anything else is refused;
* integers: digits only (``5``, not ``5.0``), in the declared range;
* numbers (seconds, factors, times): finite and above zero; ``nan``, ``inf``, ``1e400`` (inf), ``0`` and negatives
  are refused;
* a refused value raises ``ValueError`` naming the variable, the value that arrived, what is required and the fix.

The command lines use the same rules: ``count(minimum)`` and ``seconds()`` are argparse ``type=`` converters, so
argparse names the option and exits 2 (``jddp launch --peer-timeout inf`` is refused before anything starts).

Example:
  >>> parse("JDDP_STALL", "False"), parse("JDDP_PEER_TIMEOUT", "2.5"), parse("JDDP_LOCAL_DEVICES", " 4 ")
  (False, 2.5, 4)
  >>> parse("JDDP_PEER_TIMEOUT", "inf")
  Traceback (most recent call last):
  ValueError: $JDDP_PEER_TIMEOUT='inf' must be positive and finite: a number of seconds, e.g. JDDP_PEER_TIMEOUT=30; ...
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
SPELLINGS = "1/0, true/false, yes/no or on/off (any case)"


@dataclasses.dataclass(frozen=True)
class Variable:
    """One ``JDDP_*`` variable. ``kind``: ``bool``; ``int`` (at least ``minimum``); ``float`` (finite, above 0;
    ``unit`` says of what); ``path`` (a file or directory; a boolean spelling is refused, it would name a directory
    ``0`` or ``false``); ``cache`` (a directory, or a boolean: on is the default directory, off turns it off);
    ``address`` (``host:port``); ``choice`` (one of ``choices``, any case); ``ids`` (comma-separated device ids,
    indices or UUIDs: a tuple of str)."""

    name: str
    kind: str
    default: Any
    doc: str
    minimum: int = 0  # int only
    unit: str = "number of seconds"  # float only: what the number is
    choices: tuple[str, ...] = ()  # choice only
    internal: bool = False  # set by `jddp launch` for its processes, not by users

    def example(self) -> str:
        """A valid value, for messages (and for tests)."""
        if self.kind == "bool":
            return "1"
        if self.kind == "int":
            return str(self.default if isinstance(self.default, int) else self.minimum)
        if self.kind == "float":
            return f"{self.default:g}" if isinstance(self.default, float) else "1700000000.5"
        if self.kind == "address":
            return "127.0.0.1:29500"
        if self.kind == "choice":
            return self.choices[0]
        if self.kind == "json":
            return '{"round": 0}'
        if self.kind == "ids":
            return "0,1"
        return "/tmp/jddp"


def _declare(*variables: Variable) -> dict[str, Variable]:
    return {v.name: v for v in variables}


VARIABLES: dict[str, Variable] = _declare(
    # the group (jddp.initialize; set by jddp launch, or by hand for a group started otherwise)
    Variable("JDDP_COORDINATOR", "address", None, "host:port of the group's coordination service"),
    Variable("JDDP_NUM_PROCESSES", "int", None, "processes in the group", minimum=1),
    Variable("JDDP_PROCESS_ID", "int", None, "this process's index in the group, 0 to JDDP_NUM_PROCESSES - 1"),
    Variable("JDDP_LOCAL_DEVICES", "int", None, "simulated CPU devices in this process", minimum=1),
    Variable("JDDP_PEER_TIMEOUT", "float", 30.0, "seconds before a silent peer counts as dead"),
    Variable(
        "JDDP_INIT_TIMEOUT",
        "float",
        120.0,
        "the start-up timeout: seconds jddp.initialize waits for the group to form, and every process for each jddp "
        "program's first run",
    ),
    Variable("JDDP_TRANSPORT", "choice", "xla", "how DataParallel sums gradients", choices=("xla", "mpi")),
    # the stall detector (jddp.runtime.progress)
    Variable("JDDP_STALL", "bool", True, "the stall detector on (flight records and exit 70 when the group stalls)"),
    Variable("JDDP_STALL_FACTOR", "float", 10.0, "the stall bound: this many times the slowest step", unit="factor"),
    Variable("JDDP_STALL_FLOOR", "float", 60.0, "the stall bound's least seconds"),
    Variable("JDDP_STALL_CEILING", "float", 1800.0, "the stall bound's most seconds (also for phases of no length)"),
    Variable(
        "JDDP_FLIGHT_DIR", "path", None, "the directory of flight records (default fit's log_dir, else ./jddp-flight)"
    ),
    # the compilation cache (jddp.runtime.compile_cache)
    Variable(
        "JDDP_COMPILATION_CACHE",
        "cache",
        True,
        "the compilation cache's directory; on (default: $XDG_CACHE_HOME/jddp/xla or ~/.cache/jddp/xla) or off",
    ),
    # in-memory snapshots (jddp.checkpoint.snapshot)
    Variable(
        "JDDP_SNAPSHOT_DIR",
        "path",
        None,
        "a directory in memory (tmpfs, e.g. /dev/shm/...) that outlives the processes, where each keeps snapshots of "
        "the training state to restart from; jddp launch sets one per run",
    ),
    Variable(
        "JDDP_SNAPSHOTS",
        "bool",
        True,
        "in-memory snapshots where JDDP_SNAPSHOT_DIR is set (the default of Checkpointer(snapshots=None)); 0 turns "
        "them off",
    ),
    Variable(
        "JDDP_SNAPSHOT_EVERY",
        "int",
        None,
        "a fixed number of steps between in-memory snapshots (the default of Checkpointer(snapshot_every=None); "
        "unset: sized by their measured cost)",
        minimum=1,
    ),
    Variable(
        "JDDP_KEEP_STEPS",
        "choice",
        "auto",
        "the newest steps' copies kept on the devices for the survivors of a failure to write (jddp.checkpoint."
        "snapshot_kept): auto keeps them where they fit, on always, off never",
        choices=("auto", "on", "off"),
    ),
    # set by jddp launch for each process: for the script to read
    Variable("JDDP_LOCAL_RANK", "int", None, "this process's index on its node (jddp launch)", internal=True),
    Variable(
        "JDDP_PLATFORM",
        "choice",
        None,
        "the platform jddp launch found on the host (jddp.placement)",
        choices=("cpu", "cuda", "rocm", "tpu"),
        internal=True,
    ),
    Variable("JDDP_DEVICES", "ids", None, "the devices jddp launch gave this process (jddp.placement)", internal=True),
    Variable("JDDP_RESTART_COUNT", "int", 0, "the attempt: 0 first, then 1 per restart (jddp launch)", internal=True),
    Variable("JDDP_MAX_RESTARTS", "int", 0, "jddp launch's --max-restarts", internal=True),
    # handshakes between jddp launch and jddp in its processes
    Variable(
        "JDDP_COORDINATOR_HOSTED",
        "bool",
        False,
        "the launcher runs the coordination service: process 0 joins it instead of starting one",
        internal=True,
    ),
    Variable("JDDP_STDOUT_FD", "int", None, "the pipe for Python's stdout (jddp.cli.output)", internal=True),
    Variable("JDDP_MEMBERSHIP", "json", None, "an elastic round's membership, JSON (jddp.goodput)", internal=True),
    Variable(
        "JDDP_ATTEMPT_START", "float", None, "when this attempt began", unit="time in seconds since 1970", internal=True
    ),
    Variable("JDDP_RUN_START", "float", None, "when the run began", unit="time in seconds since 1970", internal=True),
    Variable(
        "JDDP_PREVIOUS_END",
        "float",
        None,
        "when the previous attempt's group ended",
        unit="time in seconds since 1970",
        internal=True,
    ),
    Variable("JDDP_LEDGER_NOTE", "path", None, "where process 0 writes its goodput ledger's path", internal=True),
    Variable("JDDP_JOB_TOKEN", "path", None, "the job's secret, 16+ characters, not a path (jddp.cli.job_token)"),
    Variable(
        "JDDP_STANDBY_FD",
        "int",
        None,
        "a standby process's socket to its launcher: the script waits there before its restore (jddp.runtime.standby)",
        internal=True,
    ),
)


class _Refused(ValueError):
    """A value that is not of its kind: ``requirement`` says what is required."""

    def __init__(self, requirement: str) -> None:
        super().__init__(requirement)
        self.requirement = requirement


def to_bool(text: str) -> bool:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off``, any case, surrounding whitespace ignored."""
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise _Refused(f"a boolean: {SPELLINGS}")


def to_int(text: str, minimum: int) -> int:
    """Digits (a sign allowed) of an integer of at least ``minimum``."""
    word = text.strip()
    at_least = "of 0 or more" if minimum == 0 else f"of at least {minimum}"
    try:
        value = int(word)
    except ValueError:
        raise _Refused(f"an integer {at_least}") from None
    if value < minimum:
        raise _Refused(f"an integer {at_least}")
    return value


def to_float(text: str, unit: str = "number of seconds") -> float:
    """A finite number above 0 (``nan``, ``inf``, ``1e400``, 0 and negatives refused)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise _Refused(f"a {unit} (finite, above 0)") from None
    if not (math.isfinite(value) and value > 0):
        raise _Refused(f"positive and finite: a {unit}")
    return value


def _convert(variable: Variable, text: str) -> Any:
    kind = variable.kind
    if kind == "bool":
        return to_bool(text)
    if kind == "int":
        return to_int(text, variable.minimum)
    if kind == "float":
        return to_float(text, variable.unit)
    word = text.strip()
    if kind == "choice":
        if word.lower() not in variable.choices:
            raise _Refused(f"one of {', '.join(variable.choices)}")
        return word.lower()
    if kind == "address":
        from jddp import net  # the standard library only

        try:
            net.split_address(word, name="$" + variable.name)
        except ValueError:
            raise _Refused("'host:port' with a port from 1 to 65535") from None
        return word
    if kind == "ids":
        ids = tuple(part.strip() for part in word.split(","))
        if not all(part and part.replace("-", "").replace("_", "").isalnum() for part in ids):
            raise _Refused("comma-separated device ids such as 0,1 (indices or UUIDs)")
        return ids
    if kind == "json":  # an object
        import json

        try:
            value = json.loads(word)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise _Refused("a JSON object")
        return value
    if kind == "cache":
        lowered = word.lower()
        return True if lowered in TRUE else False if lowered in FALSE else word
    if kind == "path":
        if word.lower() in TRUE + FALSE:
            raise _Refused(
                f"a path, not a switch ({word!r} would be a file or directory of that name: "
                f"write ./{word} if you mean one)"
            )
        return word
    raise AssertionError(f"unknown kind {kind!r} of {variable.name}")


def parse(name: str, text: str | None) -> Any:
    """``text`` as the value of variable ``name``: the declared default when ``None``, empty or whitespace.

    Raises:
      KeyError: ``name`` is not declared in ``VARIABLES``.
      ValueError: ``$NAME='text' must be ...``: what is required and how to fix it.
    """
    variable = VARIABLES[name]
    if text is None or not text.strip():
        return variable.default
    try:
        return _convert(variable, text)
    except _Refused as refused:
        default = "" if variable.default is None else f"; unset it for the default ({_show(variable.default)})"
        if variable.internal:
            default += " (jddp launch sets it for its processes: leave it to the launcher)"
        raise ValueError(
            f"${name}={text!r} must be {refused.requirement}, e.g. {name}={variable.example()}{default}."
        ) from None


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of variable ``name`` in ``environ`` (default ``os.environ``), parsed as ``parse`` does."""
    return parse(name, (os.environ if environ is None else environ).get(name))


def _show(value: Any) -> str:
    if value is True or value is False:
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


# ----------------------------------------------------------------- argparse


def count(minimum: int = 1) -> Callable[[str], int]:
    """An argparse ``type=`` for an integer of at least ``minimum``: argparse names the option on refusal."""

    def convert(text: str) -> int:
        try:
            return to_int(text, minimum)
        except _Refused as refused:
            raise argparse.ArgumentTypeError(f"must be {refused.requirement}, got {text!r}") from None

    convert.__name__ = f"integer >= {minimum}"
    convert.kind, convert.minimum = "int", minimum  # type: ignore[attr-defined]  # read by tests/test_env_boundary
    return convert


def seconds(unit: str = "number of seconds") -> Callable[[str], float]:
    """An argparse ``type=`` for a finite number above 0 (``inf``, ``nan``, 0 and negatives refused)."""

    def convert(text: str) -> float:
        try:
            return to_float(text, unit)
        except _Refused as refused:
            raise argparse.ArgumentTypeError(f"must be {refused.requirement}, got {text!r}") from None

    convert.__name__ = "positive number"
    convert.kind, convert.minimum = "float", 0  # type: ignore[attr-defined]  # read by tests/test_env_boundary
    return convert


def process_count() -> Callable[[str], int | str]:
    """An argparse ``type=`` for ``jddp launch -n``: a count of at least 1, or a placement mode (``auto``,
    ``device``, ``host``: ``jddp.placement``)."""

    def convert(text: str) -> int | str:
        word = text.strip().lower()
        if word in ("auto", "device", "host"):
            return word
        try:
            return to_int(text, 1)
        except _Refused:
            raise argparse.ArgumentTypeError(
                f"must be auto, device, host or an integer of at least 1, got {text!r}"
            ) from None

    convert.__name__ = "auto, device, host or integer >= 1"
    convert.kind, convert.minimum = "nprocs", 1  # type: ignore[attr-defined]  # read by tests/test_env_boundary
    return convert


def node_range() -> Callable[[str], tuple[int, int]]:
    """An argparse ``type=`` for a number of nodes, ``N`` (fixed) or ``MIN:MAX`` (elastic, torchrun's syntax):
    ``(N, N)`` or ``(MIN, MAX)``, with ``1 <= MIN <= MAX``; ``N`` alone is ``(N, N)``, ``N:N`` elastic all the same
    (the caller tells them apart by the colon)."""

    def convert(text: str) -> tuple[int, int]:
        parts = text.split(":")
        try:
            if len(parts) > 2:
                raise _Refused("N or MIN:MAX")
            low, high = (to_int(part, 1) for part in (parts if len(parts) == 2 else parts * 2))
        except _Refused:
            raise argparse.ArgumentTypeError(
                f"must be a number of nodes N, or MIN:MAX with 1 <= MIN <= MAX (elastic), got {text!r}"
            ) from None
        if low > high:
            raise argparse.ArgumentTypeError(f"must be MIN:MAX with MIN <= MAX, got {text!r}")
        return low, high

    convert.__name__ = "N or MIN:MAX"
    convert.kind, convert.minimum = "range", 1  # type: ignore[attr-defined]  # read by tests/test_env_boundary
    return convert


def counts(minimum: int = 1) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type=`` for comma-separated integers of at least ``minimum`` (``1,2,4``)."""

    def convert(text: str) -> tuple[int, ...]:
        try:
            return tuple(to_int(part, minimum) for part in text.split(","))
        except _Refused as refused:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated ints such as 1,2,4, got {text!r}: each must be {refused.requirement}"
            ) from None

    convert.__name__ = f"integers >= {minimum}"
    convert.kind, convert.minimum = "ints", minimum  # type: ignore[attr-defined]  # read by tests/test_env_boundary
    return convert
