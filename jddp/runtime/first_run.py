"""Every process present before a program's first run: gloo's fixed 30-s connection window opens with all peers there.

On CPU, XLA's collectives between processes are gloo's. The first collective a process runs on a set of devices
connects that set: each device publishes its address in the coordination service's key-value store and waits for
every peer's, for a fixed ``GLOO_WINDOW_S`` (30 s: gloo's ``Store::kDefaultTimeout``, which XLA's key-value store
for gloo passes on; ``make_gloo_tcp_collectives`` takes no timeout in jax 0.10, and neither ``JDDP_PEER_TIMEOUT``
nor ``JDDP_INIT_TIMEOUT`` reaches it). A peer more than 30 s late to its first collective (still importing,
loading data, compiling on a loaded machine) fails the group with ``Gloo context initialization failed:
DEADLINE_EXCEEDED: GetKeyValue() timed out``.

So jddp's programs meet first. Before the first run of each of its compiled programs in a group (the engine's step
and eval, a ``jddp.data_parallel`` step: ``jddp.runtime.dispatch``, compiled first so that compile times do not
count against gloo's window), and before ``DataParallel.init``'s first collectives, every process waits at a
barrier of the coordination service bounded by the **start-up timeout**: ``jddp.initialize(init_timeout_s=)``,
else ``$JDDP_INIT_TIMEOUT`` (``jddp launch`` passes its environment on), else 120 s. When it runs out, the process
that waited raises ``StartupTimeoutError`` naming the setting, its value, the processes that did not arrive and
how to raise it. A barrier is a collective: whether a call meets is decided from what every process holds alike
(the group's size, the program's first call, which every process makes in the same order).

When gloo's window still runs out (a peer more than 30 s late between the meeting and its first run: a process
stopped, or starved of CPU), the error is rewritten to say so (``explained``; the exit hook says it for a
script's own ``jax.jit``). A script that runs a ``jax.jit`` with collectives of its own as its first collective
calls ``jddp.barrier("first-run", timeout_s=...)`` after compiling it and before its first call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Hashable, Iterator

from jddp import envvars
from jddp.runtime import jax_internals, join_settings, peer_wait, process_group

GLOO_WINDOW_S = 30  # gloo's Store::kDefaultTimeout (gloo/rendezvous/store.h), fixed in jaxlib 0.10.2
_PREFIX = "jddp/first-run"
# The key of ``meet_once`` before the first collective over every device of the group in ``jax.devices()``'s order
# (``jax.experimental.multihost_utils``' programs: one gloo connection set-up, which later ones reuse).
GLOBAL_DEVICES = "jax.devices()"
# The gloo error of a connection set-up that ran out of time (XLA's gloo_collectives.cc and gloo_kv_store.cc).
_GLOO_SETUP = "Gloo context initialization failed"
_TIMED_OUT = ("DEADLINE_EXCEEDED", "timed out", "Deadline exceeded")

MSG_GLOO_WINDOW = (
    "gloo's connection set-up for the first collective on these devices ran out of time on process {me} in {what}: "
    "a peer did not reach its first collective within gloo's fixed {window} s (gloo's `Store::kDefaultTimeout`; "
    "jax's `make_gloo_tcp_collectives` takes no timeout, so neither JDDP_INIT_TIMEOUT nor JDDP_PEER_TIMEOUT moves "
    "it). {why} What to do: give the processes the CPU they need (fewer busy processes beside the group, "
    "`jddp launch --cpu-share`), and make every process meet before a collective program of the script's own: "
    '`jddp.barrier("first-run", timeout_s=...)` after compiling it (`jitted.lower(...).compile()`) and before its '
    "first call, or step with `jddp.data_parallel`, which meets by itself. (gloo: {first_line})"
)
_WHY_JDDP = (
    "jddp's programs meet every peer at a barrier first ({setting}), so a peer was more than {window} s late between "
    "that meeting and this run: it was stopped or starved of CPU."
)
_WHY_OWN = "It was a collective of the script's own, not one of jddp's programs (which meet every peer first)."


class StartupTimeoutError(TimeoutError):
    """The processes did not all reach a program's first run within the start-up timeout (``JDDP_INIT_TIMEOUT``)."""


_count = 0  # meetings so far (the n-th meeting of one process meets the n-th of every other)
_met: set[Hashable] = set()
_setting: tuple[float, str] | None = None  # (seconds, how it was set), recorded by jddp.initialize


def configure(timeout_s: float, *, from_argument: bool) -> None:
    """Records the start-up timeout ``jddp.initialize`` resolved (``from_argument``: its ``init_timeout_s``)."""
    global _setting
    _setting = (float(timeout_s), "init_timeout_s" if from_argument else "")


def timeout() -> tuple[float, str]:
    """The start-up timeout in seconds and the setting it came from, as its error names it."""
    env = join_settings.ENV_INIT_TIMEOUT
    if _setting is not None and _setting[1]:
        return _setting[0], f"`jddp.initialize(init_timeout_s={_setting[0]:g})`"
    value = _setting[0] if _setting is not None else float(envvars.get(env))
    if os.environ.get(env):
        return value, f"{env}={value:g}"
    return value, f"{env} unset: the default {value:g} s"


def needed() -> bool:
    """Whether this process is one of a group of several (then every process is; alone nothing meets)."""
    if jax_internals.distributed_client() is None:
        return False
    import jax

    return jax.process_count() > 1


def meet_once(key: Hashable, what: str) -> None:
    """``meet(what)`` the first time ``key`` is given in this process (every process gives the same keys in the same
    order: they are the collective calls every process makes), then nothing."""
    if key in _met:
        return
    _met.add(key)
    meet(what)


def meet(what: str) -> None:
    """Waits until every process of the group has reached this meeting (the n-th call meets the n-th), for at most
    the start-up timeout. Nothing alone.

    Raises:
      StartupTimeoutError: after the start-up timeout, naming its setting and value, the processes that did not
        arrive, and how to raise it.
    """
    client = jax_internals.distributed_client()
    if client is None or not needed():
        return
    global _count
    _count += 1
    joined = process_group.group()
    me = joined.process_id if joined is not None else _process_index()
    meeting = f"{_PREFIX}/{_count}"
    client.key_value_set(f"{meeting}/{me}", what, allow_overwrite=True)
    seconds, setting = timeout()
    try:
        with peer_wait.waiting():
            client.wait_at_barrier(meeting, max(1, int(seconds * 1000)))
    except Exception as error:  # the coordination service raises a generic runtime error
        if not any(marker in str(error) for marker in _TIMED_OUT):
            # Not the start-up timeout: the service or a peer failed at the meeting (a peer that died, node 0's
            # service gone). Raising the timeout would not help, so this error does not advise it.
            raise RuntimeError(
                f"The meeting of every process before the first run of {what} failed on process {me} before the "
                f"start-up timeout ({setting}) ran out: the coordination service said "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__!r}. A peer or the coordination "
                "service failed; the output of the other processes says which."
            ) from error
        raise StartupTimeoutError(_missed(client, meeting, me, what, seconds, setting, error)) from None


def _process_index() -> int:
    import jax

    return jax.process_index()


def _missed(client, meeting: str, me: int, what: str, seconds: float, setting: str, error: Exception) -> str:
    import jax

    try:
        arrived = {int(key.rsplit("/", 1)[1]): value for key, value in client.key_value_dir_get(f"{meeting}/")}
    except Exception:  # the service itself is gone: name no one rather than everyone
        arrived = None
    n = jax.process_count()
    if arrived is None:
        who = "the coordination service did not say which processes arrived"
    else:
        missing = sorted(set(range(n)) - set(arrived))
        elsewhere = sorted(p for p, w in arrived.items() if w != what)
        who = f"process(es) {missing} did not arrive" if missing else "every process arrived, too late"
        if elsewhere:
            who += "; " + ", ".join(f"process {p} met before {arrived[p]}" for p in elsewhere)
    env, longer = join_settings.ENV_INIT_TIMEOUT, f"{max(2 * seconds, 120):g}"
    if setting.startswith("`jddp.initialize"):  # the argument overrides the variable: only the argument helps
        raise_it = f"pass `jddp.initialize(init_timeout_s={longer})`"
    else:
        raise_it = (
            f"set {env}={longer} (`jddp launch --init-timeout {longer}` or the variable, which `jddp launch` passes "
            "to every process) or `jddp.initialize(init_timeout_s=...)`"
        )
    return (
        f"The processes did not all reach the first run of {what} within the start-up timeout ({setting}) on "
        f"process {me}: {who} ({str(error).splitlines()[0] if str(error) else type(error).__name__}). Every process "
        f"meets there before its first collective, so that gloo's fixed {GLOO_WINDOW_S} s connection window opens with "
        f"every peer present. A process that is only slow (importing, loading data, compiling on a loaded machine) "
        f"needs a longer start-up timeout: {raise_it}; one that never arrives is stuck or took another path (its "
        "output says where)."
    )


# ------------------------------------------------------------------------------------------ gloo's own window


def is_gloo_window(error: BaseException) -> bool:
    """Whether ``error`` is gloo's connection set-up running out of its fixed 30 s (a peer late to its first
    collective on a set of devices)."""
    text = str(error)
    return _GLOO_SETUP in text and any(marker in text for marker in _TIMED_OUT)


def gloo_window_message(error: BaseException, what: str, *, met: bool) -> str:
    """What ``error`` (``is_gloo_window``) means, for a process that ran ``what`` (``met``: after a meeting)."""
    import jax

    setting = timeout()[1]
    why = _WHY_JDDP.format(setting=setting, window=GLOO_WINDOW_S) if met else _WHY_OWN
    first_line = next((line for line in str(error).splitlines() if _GLOO_SETUP in line), str(error).splitlines()[0])
    return MSG_GLOO_WINDOW.format(
        me=jax.process_index(), what=what, window=GLOO_WINDOW_S, why=why, first_line=first_line.strip()
    )


@contextlib.contextmanager
def explained(what: str) -> Iterator[None]:
    """Around a jddp program's run: gloo's window running out is re-raised as a ``TimeoutError`` that says what it
    is and what to do (the original chained)."""
    try:
        yield
    except Exception as error:
        if not is_gloo_window(error):
            raise
        raise TimeoutError(gloo_window_message(error, what, met=True)) from error
