"""Start-up never spends a restart: every process meets before a program's first run (``jddp.runtime.first_run``)."""

from __future__ import annotations

import concurrent.futures
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jddp import exitcodes
from jddp.runtime import dispatch, exit_hooks, first_run, join_settings
from tests import models, multiprocess

LATE = str(multiprocess.WORKERS / "late_peer.py")

# What XLA's gloo collectives raised here (jax 0.10.2) when a peer was 45 s late to its first collective.
GLOO_WINDOW_ERROR = (
    "INTERNAL: Gloo context initialization failed: [enforce fail at external/gloo/gloo/rendezvous/context.cc:86] "
    "DEADLINE_EXCEEDED: GetKeyValue() timed out with key: gloo/0,1/1 and duration: 29.99s"
)


# ------------------------------------------------------------ the start-up timeout's setting, as the error names it


@pytest.mark.parametrize(
    ("argument", "env", "named"),
    [
        (None, None, "JDDP_INIT_TIMEOUT unset: the default 120 s"),
        (None, "7", "JDDP_INIT_TIMEOUT=7"),
        (9.0, "7", "`jddp.initialize(init_timeout_s=9)`"),
        (9.0, None, "`jddp.initialize(init_timeout_s=9)`"),
    ],
    ids=["default", "variable", "argument-over-variable", "argument"],
)
def test_the_start_up_timeout_is_named_by_the_setting_that_gave_it(monkeypatch, argument, env, named):
    """Every way to set the start-up timeout (``jddp.initialize``'s resolution: the argument, else the variable,
    else the default) is the one its error names, with the value in force."""
    monkeypatch.setattr(first_run, "_setting", None)
    if env is None:
        monkeypatch.delenv(join_settings.ENV_INIT_TIMEOUT, raising=False)
    else:
        monkeypatch.setenv(join_settings.ENV_INIT_TIMEOUT, env)
    if argument is not None or env is not None:
        resolved = join_settings.Settings.resolve("127.0.0.1:1", 2, 0, None, argument, None, None)
        first_run.configure(resolved.init_timeout_s, from_argument=argument is not None)
    seconds, setting = first_run.timeout()
    assert setting == named
    assert seconds == (argument if argument is not None else float(env) if env is not None else 120.0)


class FakeClient:
    """The coordination service's key-value store and a barrier that times out, as JAX's client answers."""

    def __init__(self, arrived: dict[int, str]):
        self.store = {f"jddp/first-run/1/{p}": what for p, what in arrived.items()}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.store[key] = value

    def wait_at_barrier(self, name, timeout_ms):
        raise RuntimeError(f"DEADLINE_EXCEEDED: Barrier timed out. Id: {name}\nmore text")

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.store.items() if k.startswith(prefix)]


@pytest.mark.parametrize("processes", [2, 3, 4])
def test_a_meeting_that_times_out_names_the_setting_the_value_and_every_missing_process(monkeypatch, processes):
    """Process 0 waits alone at the meeting: the error names the setting and its value, each process that did not
    arrive (every other one, whatever the group's size), the program, and how to raise the timeout."""
    client = FakeClient({})
    monkeypatch.setattr(first_run.jax_internals, "distributed_client", lambda: client)
    monkeypatch.setattr(first_run, "needed", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    monkeypatch.setattr(first_run, "_count", 0)
    monkeypatch.setattr(first_run, "_setting", (5.0, ""))
    monkeypatch.setenv(join_settings.ENV_INIT_TIMEOUT, "5")
    with pytest.raises(first_run.StartupTimeoutError) as raised:
        first_run.meet("DataParallel.step")
    text = str(raised.value)
    assert "first run of DataParallel.step within the start-up timeout (JDDP_INIT_TIMEOUT=5) on process 0" in text
    assert f"process(es) {list(range(1, processes))} did not arrive" in text
    assert "set JDDP_INIT_TIMEOUT=120" in text and "init_timeout_s=" in text
    assert isinstance(raised.value, TimeoutError)


class FailingClient(FakeClient):
    """A barrier that fails at once, as JAX's client raises when the service or a peer fails during it."""

    def __init__(self, text: str):
        super().__init__({})
        self.text = text

    def wait_at_barrier(self, name, timeout_ms):
        raise RuntimeError(self.text)


# The coordination service's failures other than the deadline (grpc status names: a peer that died, the service
# gone, a barrier another process cancelled), each as its first line.
SERVICE_FAILURES = [
    f"{status}: {detail}"
    for status in ("UNAVAILABLE", "ABORTED", "CANCELLED", "INTERNAL", "FAILED_PRECONDITION")
    for detail in ("Failed to send RPC to coordination service. Connection reset by peer", "task /job:jax/task:1 error")
]


@pytest.mark.parametrize("text", SERVICE_FAILURES)
def test_a_meeting_that_fails_at_once_is_not_called_a_timeout(monkeypatch, text):
    """A peer or the service failing during the meeting is named as that, with the service's words, and does not
    advise a longer start-up timeout (which would not help)."""
    monkeypatch.setattr(first_run.jax_internals, "distributed_client", lambda: FailingClient(text))
    monkeypatch.setattr(first_run, "needed", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(first_run, "_count", 0)
    with pytest.raises(RuntimeError) as raised:
        first_run.meet("DataParallel.step")
    message = str(raised.value)
    assert not isinstance(raised.value, TimeoutError), message
    assert text.splitlines()[0] in message and "first run of DataParallel.step" in message, message
    assert "JDDP_INIT_TIMEOUT=" not in message and "A peer or the coordination service failed" in message, message


def test_a_timeout_set_by_the_argument_advises_the_argument(monkeypatch):
    """``jddp.initialize(init_timeout_s=)`` overrides the variable: the advice is the argument alone."""
    monkeypatch.setattr(first_run.jax_internals, "distributed_client", lambda: FakeClient({}))
    monkeypatch.setattr(first_run, "needed", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(first_run, "_count", 0)
    monkeypatch.setattr(first_run, "_setting", (30.0, "init_timeout_s"))
    with pytest.raises(first_run.StartupTimeoutError) as raised:
        first_run.meet("DataParallel.step")
    message = str(raised.value)
    assert "pass `jddp.initialize(init_timeout_s=120)`" in message and "JDDP_INIT_TIMEOUT=" not in message, message


def test_a_peer_that_met_before_another_program_is_named_with_it(monkeypatch):
    """Processes that reach different first runs at the same meeting (one process made another call) are named
    with the program each met before."""
    client = FakeClient({1: "DataParallel.eval_step"})
    monkeypatch.setattr(first_run.jax_internals, "distributed_client", lambda: client)
    monkeypatch.setattr(first_run, "needed", lambda: True)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(first_run, "_count", 0)
    with pytest.raises(first_run.StartupTimeoutError, match=r"process 1 met before DataParallel\.eval_step"):
        first_run.meet("DataParallel.step")


def test_alone_nothing_meets():
    """A single process (no group) meets no one and returns at once."""
    assert not first_run.needed()
    first_run.meet("DataParallel.step")


# ------------------------------------------------------------ the first call: compiled, then met, then run


def test_a_first_call_compiles_then_meets_then_runs_without_compiling_again(monkeypatch):
    """In a group, the dispatcher compiles a program's first call, meets the group, and runs it: one compilation
    (the run finds it in JAX's cache), the meeting after it and before the run, and later calls meet no more."""
    met, runs, traced = [], [], []
    program = jax.jit(lambda x: (traced.append(1), x * 2.0)[1])
    x = jnp.arange(3.0)
    calls = dispatch.Dispatcher()
    with models.counting_compiles() as compiles:
        monkeypatch.setattr(first_run, "needed", lambda: True)
        monkeypatch.setattr(first_run, "meet", lambda what: met.append((what, len(compiles))))
        for _ in range(3):
            out = calls.call(program, (x,), first=calls.first_call(program), label="double")
            runs.append(len(compiles))
    np.testing.assert_array_equal(out, 2 * np.arange(3.0))
    assert met == [("double", 1)]  # met once, after the one compilation
    assert runs == [1, 1, 1] and len(traced) == 1  # run without tracing or compiling again


def test_every_new_program_is_a_first_call_even_where_a_collected_one_held_its_id():
    """Whether a call is a program's first decides whether the process meets its peers, so it must be the same on
    every process: a program made after another was collected is new, even where it got the collected one's id
    (CPython reuses them; when it does depends on each process's collections)."""
    calls = dispatch.Dispatcher()
    ids, firsts = set(), []
    for _ in range(20):
        program = jax.jit(lambda x: x + 1)
        ids.add(id(program))
        firsts.append(calls.first_call(program))
        del program  # freed at once (no cycle): the next one may take its id
    assert len(ids) < 20, "no id was reused: the case this test is about did not arise"
    assert all(firsts)


# ------------------------------------------------------------ gloo's own window, explained


def test_gloos_window_running_out_is_rewritten_to_say_what_it_is_and_what_to_do():
    """A jddp program whose first run meets gloo's 30-s window (a peer late after the meeting) raises a
    TimeoutError saying it is gloo's fixed window, that the settings do not move it, and what to do, with gloo's
    line kept (so the exit hook still treats it as a collective failure)."""
    with pytest.raises(TimeoutError) as raised, first_run.explained("DataParallel.step"):
        raise RuntimeError(GLOO_WINDOW_ERROR)
    text = str(raised.value)
    assert "gloo's fixed 30 s" in text and "neither JDDP_INIT_TIMEOUT nor JDDP_PEER_TIMEOUT moves it" in text
    assert "in DataParallel.step" in text and 'jddp.barrier("first-run"' in text
    assert exit_hooks.is_collective_failure(raised.value)
    assert isinstance(raised.value.__cause__, RuntimeError)


class _RunFailed:
    """A step's packed metrics whose run failed in gloo's window: reading them raises what XLA raised."""

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError(GLOO_WINDOW_ERROR)


def test_a_steps_metrics_read_after_gloos_window_ran_out_say_what_it_is():
    """On CPU the step returns before it runs, so gloo's error comes with its metrics: reading them raises the
    explained TimeoutError too, with gloo's error chained."""
    from jddp.engine import metrics

    read = metrics.Metrics(("loss",), _RunFailed())  # pyright: ignore[reportArgumentType]  # the packed vector's stand-in
    with pytest.raises(TimeoutError, match=r"in the step these metrics come from: .*gloo's fixed 30 s") as raised:
        read["loss"]
    assert isinstance(raised.value.__cause__, RuntimeError)


@pytest.mark.parametrize(
    "text",
    [
        "Gloo context initialization failed: Connection refused",  # a set-up that failed otherwise
        "DEADLINE_EXCEEDED: Barrier timed out",  # the coordination service's, not gloo's
        "Connection closed by peer [127.0.0.1]:1234",  # a peer lost mid-run
    ],
    ids=["gloo-refused", "barrier", "closed"],
)
def test_other_errors_pass_through_unchanged(text):
    with pytest.raises(RuntimeError, match=re.escape(text)), first_run.explained("DataParallel.step"):
        raise RuntimeError(text)


# ------------------------------------------------------------ real processes


LATE_PATHS = {  # where process 1 is late: (the worker's path, devices per process)
    "before-DataParallel.init": ("dp", 1),
    "before-data_parallel": ("own", 1),
    "after-init-before-the-first-step-2-devices-each": ("step", 2),
    "the-guides-own-jit-pattern": ("jit", 1),
}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_peer_40_s_late_to_its_first_collective_trains_and_finishes():
    """Process 1 reaches a first collective 40 s after process 0 (past gloo's fixed 30-s window): the group meets
    first under the start-up timeout (120 s), then trains and finishes, with no restart: late to ``DataParallel.init``,
    to a script's own step (``jddp.data_parallel``), with 2 devices a process late after ``init`` to the first step
    (whose collectives connect another set of devices than init's: gloo's window again), and to a ``jax.jit`` of the
    script's own met as the launch guide says (compiled, ``jddp.barrier``, run). The four groups run side by side:
    each waits 40 s, asleep (one after the other, the four took 3 minutes of the suite)."""

    def late(path: str, devices: int) -> subprocess.CompletedProcess:
        argv = ["-n", "2", "--devices-per-process", str(devices), "--max-restarts", "0", LATE, "40", "3", path]
        return multiprocess.launch(*argv, timeout=400)

    with concurrent.futures.ThreadPoolExecutor(len(LATE_PATHS)) as pool:
        runs = {name: pool.submit(late, *where) for name, where in LATE_PATHS.items()}
    for name, run in runs.items():
        done = run.result()
        shown = f"{name}:\n{done.stdout[-3000:]}{done.stderr[-5000:]}"
        assert done.returncode == 0, shown
        trained = re.findall(r"TRAINED 3 (\S+)", done.stdout)
        assert len(trained) == 2 and len(set(trained)) == 1, shown
        assert "Gloo context initialization failed" not in done.stdout + done.stderr, shown


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_peer_later_than_the_start_up_timeout_is_named_with_the_setting_and_restarts_stay_bounded():
    """``JDDP_INIT_TIMEOUT=5`` and process 1 15 s late: process 0, which waited, raises naming the variable, its
    value and process 1; the launcher restarts once (``--max-restarts 1``), fails the same way, and exits non-zero
    with no further restart."""
    done = multiprocess.launch(
        "-n", "2", "--max-restarts", "1", "--kill-grace", "1", LATE, "15", timeout=400, env={"JDDP_INIT_TIMEOUT": "5"}
    )
    shown = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode not in (0, None), shown
    named = re.findall(
        r"\[0\] .*StartupTimeoutError: The processes did not all reach the first run of DataParallel\.init within the "
        r"start-up timeout \(JDDP_INIT_TIMEOUT=5\) on process 0: process\(es\) \[1\] did not arrive",
        done.stderr,
    )
    assert len(named) == 2, shown  # once per attempt
    assert "restarting the group (1 of 1)" in done.stderr, shown
    assert "restarting the group (2 of" not in done.stderr, shown
    assert "no restart left (--max-restarts 1)" in done.stderr, shown


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gloos_window_in_a_collective_of_the_scripts_own_is_explained_by_the_exit_hook():
    """Process 0's first collective is the script's own (``multihost_utils.process_allgather``) and process 1 never
    comes (it exits 0): gloo's 30-s window runs out outside jddp's programs, and process 0's exit hook says what it
    is (gloo's fixed window, a collective of the script's own) and what to do, before the watchdog names the lost
    process (exit 69)."""
    worker = str(multiprocess.WORKERS / "exit_in_own_collective.py")
    done = multiprocess.launch("-n", "2", "--peer-timeout", "10", worker, timeout=240)
    shown = done.stdout[-3000:] + done.stderr[-5000:]
    assert done.returncode == exitcodes.EXIT_PEER_LOST, shown
    said = [line for line in done.stderr.splitlines() if line.startswith("[0] jddp: gloo's connection set-up")]
    assert len(said) == 1, shown
    assert "within gloo's fixed 30 s" in said[0] and "It was a collective of the script's own" in said[0], shown
    assert 'jddp.barrier("first-run"' in said[0], shown
