"""A hand-written loop compiles in standby as ``jddp.fit`` does (``jddp.runtime.standby``, ``jddp.engine.ahead``).

The tests of one process make the pytest process a standby process: its socket to a launcher is one end of a
socket pair, whose other end a thread of the test plays (it reads ``STANDING_BY``, noting how many compilations
had happened by then, and sends the wake). The multi-process test runs a hand-written loop under ``jddp launch``
and kills it once its standby processes stand by.
"""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.cli import launch as launch_lib
from jddp.handoff import STANDING_BY
from jddp.runtime import standby
from tests import multiprocess
from tests.models import counting_compiles

N_DEVICES = 4


class Launcher:
    """The launcher's end of a standby process's socket: notes the compilations done when ``STANDING_BY`` came."""

    def __init__(self, channel: socket.socket, compiles: list[str]):
        self.channel, self.compiles = channel, compiles
        self.stood_by_after: int | None = None  # compilations seen when the process said it stands by
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.channel.recv(64)
            if not chunk:
                return  # the process ended before it stood by
            data += chunk
        assert data == STANDING_BY
        self.stood_by_after = len(self.compiles)
        self.channel.sendall(json.dumps({"env": {"JDDP_TEST_WOKEN": "1"}}).encode() + b"\n")


@pytest.fixture
def in_standby(monkeypatch):
    """A function that makes this process a standby process not yet woken, and starts its launcher's end."""
    for name in ("_on_wake", "_before", "_sources", "_train", "_restoring"):
        monkeypatch.setattr(standby, name, [])
    monkeypatch.delenv("JDDP_TEST_WOKEN", raising=False)
    ours, theirs = socket.socketpair()
    launchers: list[Launcher] = []

    def start(compiles: list[str]) -> Launcher:
        monkeypatch.setattr(standby, "_fd", [ours.detach()])
        launchers.append(Launcher(theirs, compiles))
        return launchers[-1]

    yield start
    if standby._fd and standby._fd[0] is not None:  # never stood by: its end is still ours to close
        os.close(standby._fd[0])
    theirs.shutdown(socket.SHUT_RDWR)  # the launcher's end reads its end of file
    for launcher in launchers:
        launcher.thread.join(10)
    theirs.close()
    ours.close()


def loss_fn(params, model_state, batch, rng):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return jddp.masked_mean((h @ params["w2"] - batch["y"]) ** 2, batch.get("mask")), (model_state, {})


def eval_fn(params, model_state, batch):
    return {"abs": jddp.masked_mean(jnp.abs(jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]), batch.get("mask"))}


def data(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 6)).astype(np.float32), "y": rng.normal(size=(n, 1)).astype(np.float32)}


PARAMS = {"w1": np.full((6, 8), 0.1, np.float32), "w2": np.full((8, 1), 0.2, np.float32)}


def mesh():
    if len(jax.devices()) < N_DEVICES:
        pytest.skip(f"needs {N_DEVICES} devices")
    return jddp.data_mesh(jax.devices()[:N_DEVICES])


# What changes the step program's signature: the engine's options that change its state (ZeRO's sharded optimizer
# state, float16's loss scale) or its batch (micro-batches); each must still find its program compiled ahead.
ENGINES = {
    "default": {},
    "accumulate": {"accumulate_steps": 2},
    "zero": {"shard_optimizer": True},
    "float16": {"compute_dtype": jnp.float16},
}


@pytest.mark.parametrize(
    "options",
    [pytest.param(v, id=k, marks=() if k == "default" else pytest.mark.slow) for k, v in ENGINES.items()],
)
def test_a_hand_written_loop_compiles_before_it_stands_by_and_its_first_step_and_eval_after_the_wake_do_not(
    in_standby, tmp_path, options
):
    """Restored from a checkpoint (saved before this process became a standby one), then trained and evaluated by
    hand: everything compiled before ``STANDING_BY``, nothing after the wake; the loaders' positions untouched by
    the standby's work."""
    m = mesh()
    dp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=m, eval_fn=eval_fn, **options)
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:  # an earlier attempt's save: the restore finds it
        ckpt.save(dp.init(PARAMS), jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m))
    with counting_compiles() as compiles:
        launcher = in_standby(compiles)
        state = dp.init(PARAMS)
        loader = jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
        evaluation = jddp.data.DataLoader(data(40, 1), global_batch_size=24, shuffle=False, drop_last=False, mesh=m)
        ckpt = jddp.Checkpointer(tmp_path / "ckpt")
        positions = (loader.get_state(), evaluation.get_state())
        before = len(compiles)
        state, loader = ckpt.restore_or_init(state, loader)  # waits: compiles, stands by, is woken, restores
        assert os.environ.get("JDDP_TEST_WOKEN") == "1" and not standby.active()
        assert launcher.stood_by_after is not None and launcher.stood_by_after > before  # compiled in standby
        assert (loader.get_state(), evaluation.get_state()) == positions
        assert int(state.step) == 0 and ckpt.restored_from is not None
        after_wake = len(compiles)
        state, metrics = dp.step(state, next(iter(loader)))
        float(metrics["loss"])
        assert compiles[after_wake:] == [], "the first step after the wake compiled"
        dp.eval_step(state, next(iter(evaluation)))["abs"]
        assert compiles[after_wake:] == [], "the first evaluation after the wake compiled"
        ckpt.close()


def test_nothing_is_written_printed_or_moved_before_the_wake(in_standby, tmp_path, capfd):
    """The standby's work (reading a batch of each loader, compiling) writes no file, prints nothing and moves no
    loader; the state it compiled for stays live (not donated)."""
    m = mesh()
    launcher = in_standby([])
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=m, eval_fn=eval_fn)
    state = dp.init(PARAMS)
    loader = jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
    evaluation = jddp.data.DataLoader(data(40, 1), global_batch_size=24, shuffle=False, drop_last=False, mesh=m)
    positions = (loader.get_state(), evaluation.get_state())
    seen: dict[str, object] = {}

    def at_wake():
        seen["files"] = sorted(tmp_path.rglob("*"))
        seen["positions"] = (loader.get_state(), evaluation.get_state())
        seen["state"] = [np.asarray(x) for x in jax.tree.leaves(state)]

    standby.on_wake(at_wake)
    capfd.readouterr()
    standby.wait()
    assert capfd.readouterr() == ("", "")
    assert launcher.stood_by_after is not None
    assert seen["files"] == [] and seen["positions"] == positions
    for got, want in zip(seen["state"], jax.tree.leaves(dp.init(PARAMS)), strict=True):  # pyright: ignore
        np.testing.assert_array_equal(got, np.asarray(want))


def test_the_loader_the_restore_names_is_the_training_one_whatever_the_order_they_were_built_in(in_standby):
    """An evaluation loader built first: the restore names the training loader (``standby.restoring``, as
    ``restore_or_init`` and ``jddp.fit`` do), and the step is compiled for its batch, not the first one's."""
    m = mesh()
    with counting_compiles() as compiles:
        launcher = in_standby(compiles)
        dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=m)
        state = dp.init(PARAMS)
        evaluation = jddp.data.DataLoader(data(40, 1), global_batch_size=24, shuffle=False, drop_last=False, mesh=m)
        loader = jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
        standby.restoring(state, loader)
        standby.wait()
        assert launcher.stood_by_after
        after_wake = len(compiles)
        dp.step(state, next(iter(loader)))
        assert compiles[after_wake:] == [], "the step compiled after the wake: compiled ahead for another loader"
        del evaluation


def own_state():
    return {"params": {k: jnp.asarray(v) for k, v in PARAMS.items()}, "opt": optax.sgd(0.1).init(PARAMS), "step": 0}


def own_step(state, batch):
    def loss(params):
        return loss_fn(params, {}, batch, None)[0]

    value, grads = jax.value_and_grad(loss)(state["params"])
    grads = jddp.global_mean(grads)
    updates, opt = optax.sgd(0.1).update(grads, state["opt"], state["params"])
    new = {"params": optax.apply_updates(state["params"], updates), "opt": opt, "step": state["step"] + 1}
    return new, jddp.global_mean(value)


def test_a_script_s_own_step_compiles_before_it_stands_by_for_the_restore_s_state(in_standby, tmp_path):
    """``jddp.data_parallel(train_step, batch_argnums=1)`` and a state of the script's own (a dict, its step a
    Python int as Flax's ``TrainState.step`` starts): compiled for the state the restore is given
    (``standby.restoring``, as ``restore_or_init`` names it) and the loader's batch; the first call after the wake,
    on the restored state, does not compile."""
    m = mesh()
    step = jddp.data_parallel(own_step, batch_argnums=1, donate_argnums=0, mesh=m)
    loader = jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:  # an earlier attempt's save, after a step
        trained, _ = step(own_state(), next(iter(loader)))
        ckpt.save(trained, loader, step=1)
    with counting_compiles() as compiles:
        launcher = in_standby(compiles)
        step = jddp.data_parallel(own_step, batch_argnums=1, donate_argnums=0, mesh=m)
        loader = jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
        ckpt = jddp.Checkpointer(tmp_path / "ckpt")
        state = own_state()
        state, loader = ckpt.restore_or_init(state, loader)  # names the state and the loader to standby
        assert launcher.stood_by_after is not None and launcher.stood_by_after > 0
        assert int(state["step"]) == 1
        after_wake = len(compiles)
        state, loss = step(state, next(iter(loader)))
        float(loss)
        assert compiles[after_wake:] == [], "the first call after the wake compiled"
        ckpt.close()


def three_arguments(state, batch, scale):
    new, loss = own_step(state, batch)
    return new, loss * scale


def test_a_step_whose_arguments_cannot_be_known_ahead_compiles_after_the_wake_and_nothing_fails(in_standby):
    """A step of three arguments: what the third will be is unknown in standby; nothing is compiled for it there,
    the standby stands by, and the first call after the wake compiles and runs."""
    m = mesh()
    with counting_compiles() as compiles:
        launcher = in_standby(compiles)
        step = jddp.data_parallel(three_arguments, batch_argnums=1, mesh=m)
        loader = jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
        assert len(standby._before) == 1 and len(standby._sources) == 1
        standby.restoring(own_state(), loader)
        standby.wait()
        assert launcher.stood_by_after == 0
        step(own_state(), next(iter(loader)), jnp.float32(2.0))
        assert compiles


def test_a_loader_the_script_dropped_is_not_read_nor_kept(in_standby):
    m = mesh()
    in_standby([])
    loader = jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
    assert standby._live_sources()
    del loader
    gc.collect()
    assert standby._live_sources() == [] and standby.batch_ahead() is None


def test_outside_standby_nothing_is_registered_or_kept():
    """In a process that is not a standby one (every process but the next attempt's), the hooks and the batch
    sources are dropped at once: nothing is compiled ahead, no loader is held."""
    assert not standby.active()
    m = mesh()
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=m)
    dp.init(PARAMS)
    jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
    jddp.data_parallel(own_step, batch_argnums=1, mesh=m)
    standby.restoring(own_state())
    standby.before_standing_by(lambda: None)
    standby.offer_batch(lambda: None)
    assert standby._before == [] and standby._sources == [] and standby._restoring == []


class Exited(BaseException):
    pass


def broken_loss(params, model_state, batch, rng):
    return jnp.mean(batch["x"] @ params["w2"]), (model_state, {})  # (.., 6) @ (8, 1): fails while tracing


HOOK_FAILURES = {
    "the step does not trace": lambda m: (
        dp := jddp.DataParallel(broken_loss, optax.sgd(0.1), mesh=m),
        dp.init(PARAMS),
    ),
    "the hook waits for the wake": lambda m: standby.before_standing_by(standby.wait),
}


@pytest.mark.parametrize("make", HOOK_FAILURES.values(), ids=HOOK_FAILURES.keys())
def test_a_failure_before_standing_by_ends_the_process_with_its_traceback_and_it_never_stands_by(
    in_standby, monkeypatch, capfd, make
):
    """Not swallowed: the error and its traceback on stderr, the process ends (exit 1, no exit hooks: its peers
    stand by) before it says ``STANDING_BY``; the launcher then starts the restart's process anew."""
    m = mesh()

    def exit_now(code):
        raise Exited(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    launcher = in_standby([])
    kept = make(m), jddp.data.DataLoader(data(64, 0), global_batch_size=16, seed=0, mesh=m)
    with pytest.raises(Exited) as exited:
        standby.wait()
    assert exited.value.args == (standby.EXIT_NOT_READY,)
    err = capfd.readouterr().err
    assert "preparing this process for the restart failed" in err and "Traceback" in err, err
    assert re.search(r"TypeError|ValueError|RuntimeError", err), err
    assert launcher.stood_by_after is None
    del kept


WORKER = str(multiprocess.WORKERS / "standby_compile.py")
KILL_AT = 6


def launched(out: Path, restarts: int, ready: Path | None, **env: str) -> subprocess.CompletedProcess:
    """The hand-written loop under ``jddp launch -n 2 --max-restarts restarts``; ``ready`` is touched when the
    launcher says its standby processes stand by, or that one ended before it did (the worker's process 1 then
    kills itself after step KILL_AT)."""
    out.mkdir()
    env = multiprocess.environment(
        JDDP_SNAPSHOT_DIR=str(out / "memory"), **({"KILL_ONCE": f"{KILL_AT}:{ready}"} if ready else {}), **env
    )
    argv = [sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", str(restarts), "--peer-timeout", "15",
            WORKER, str(out)]  # fmt: skip
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=multiprocess.ROOT)  # fmt: skip
    said: list[str] = []
    printed: list[str] = []

    def read(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line)
            if ready is not None and (launch_lib.STANDBY_READY in line or "ended before it stood by" in line):
                ready.touch()

    readers = [threading.Thread(target=read, args=pair, daemon=True) for pair in
               ((launcher.stderr, said), (launcher.stdout, printed))]  # fmt: skip
    multiprocess.wait_read(launcher, readers, 300)
    return subprocess.CompletedProcess(argv, launcher.returncode, "".join(printed), "".join(said))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, np.ndarray]:
    """The hand-written loop's final parameters, run once without a failure (no restarts: no standby beside it)."""
    out = tmp_path_factory.mktemp("standby-compile") / "clean"
    clean = launched(out, 0, None)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    return dict(np.load(out / "final.npz"))


def assert_bitwise(out: Path, want: dict[str, np.ndarray]) -> None:
    got = np.load(out / "final.npz")
    assert sorted(got.files) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_hand_written_loop_woken_from_standby_takes_its_first_step_without_compiling_and_ends_bitwise(
    tmp_path, uninterrupted
):
    """Two processes, a loop of the script's own (``DataParallel`` + ``DataLoader`` + ``Checkpointer``); process 1
    SIGKILLs itself after step 6 once the launcher says its standby processes stand by. Both woken processes' first
    step compiles nothing (JAX's compile events around it, counted by the worker: it traced, lowered and compiled
    in attempt 0), and the run ends bitwise equal to an uninterrupted one."""
    done = launched(tmp_path / "killed", 1, tmp_path / "ready")
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown
    assert re.search(r"process\(es\) 0 \(pid \d+\), 1 \(pid \d+\) woken from standby", shown), shown
    first = {}
    for line in (tmp_path / "killed" / "notes").read_text().splitlines():
        _, attempt, process, restored, compiles = line.split()
        first[int(attempt), int(process)] = (int(restored), int(compiles))
    assert set(first) == {(a, p) for a in range(2) for p in range(2)}, first
    assert all(first[0, p][1] > 0 for p in range(2)), first  # the counter sees a compilation
    assert all(first[1, p][0] > 0 for p in range(2)), first  # attempt 1 restored, and then
    assert [first[1, p][1] for p in range(2)] == [0, 0], f"{first}\n{shown}"  # compiled nothing for its first step
    assert_bitwise(tmp_path / "killed", uninterrupted)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_compilation_that_fails_in_standby_is_shown_and_the_restart_starts_anew_and_ends_bitwise(
    tmp_path, uninterrupted
):
    """The loss fails to trace in the standby processes only: each ends before it stands by, the launcher shows its
    traceback, the restart starts its processes anew (they compile after their start, and train), and the run
    ends bitwise equal to an uninterrupted one."""
    done = launched(tmp_path / "broken", 1, tmp_path / "ready", BREAK_IN_STANDBY="1")
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown
    ended = r"the standby process for process [01]( of attempt \d+)? ended before it stood by \(failed with exit code 1"
    assert re.search(ended, done.stderr), shown
    assert re.search(r"^\[[01]\] RuntimeError: COMPILE FAILS IN STANDBY$", done.stderr, re.MULTILINE), shown
    assert "preparing this process for the restart failed" in done.stderr, shown
    assert "woken from standby" not in shown, shown
    attempts = {line.split()[1] for line in (tmp_path / "broken" / "notes").read_text().splitlines()}
    assert attempts == {"0", "1"}, shown
    assert_bitwise(tmp_path / "broken", uninterrupted)
