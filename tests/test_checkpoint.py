"""jddp.Checkpointer: exact resume, damage fallback, topology changes, preemption, clear errors."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp import exitcodes
from jddp.checkpoint import config_fingerprint
from jddp.cli import launch as launch_lib
from tests import multiprocess, replay

WORKER = str(multiprocess.WORKERS / "ckpt_train.py")

rng = np.random.default_rng(0)
SOURCE = {
    "x": rng.normal(size=(200, 16)).astype(np.float32),
    "y": rng.integers(0, 4, 200).astype(np.int32),
    "id": np.arange(200, dtype=np.int32),
}


def loss_fn(params, model_state, batch, key):
    logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
    return loss, (model_state, {})


def make(devices: int, hidden: int = 32):
    mesh = jddp.data_mesh(jax.devices()[:devices])
    dp = jddp.DataParallel(loss_fn, optax.adamw(1e-2), mesh=mesh)
    init = np.random.default_rng(1)
    params = {
        "w1": init.normal(size=(16, hidden)).astype(np.float32) * 0.3,
        "w2": init.normal(size=(hidden, 4)).astype(np.float32) * 0.3,
    }
    state = dp.init(params, rng=7)
    loader = jddp.data.DataLoader(SOURCE, global_batch_size=16, seed=5, mesh=mesh)
    return dp, state, loader


def train(dp, state, loader, until: int, ckpt=None):
    """Steps until ``state.step == until``; returns the state and the ids each step consumed."""
    consumed = {}
    step = int(state.step)
    while step < until:
        for batch in loader:
            ids = np.asarray(batch["id"])[np.asarray(batch["mask"]) > 0]
            state, _ = dp.step(state, batch)
            step += 1
            consumed[step] = ids.tolist()
            if ckpt is not None:
                ckpt.maybe_save(state, loader)
            if step == until:
                break
    return state, consumed


@pytest.fixture(scope="module")
def uninterrupted():
    dp, state, loader = make(4)
    state, consumed = train(dp, state, loader, 20)
    return jax.tree.map(np.asarray, state.params), consumed


def test_resume_is_bitwise_exact_and_continues_the_data_sequence(tmp_path, uninterrupted):
    reference, consumed_ref = uninterrupted
    dp, state, loader = make(4)
    ckpt = jddp.Checkpointer(tmp_path, save_every=4, max_to_keep=2)
    state, loader = ckpt.restore_or_init(state, loader)
    assert int(state.step) == 0
    state, _ = train(dp, state, loader, 11, ckpt)  # "killed" after step 11: the last checkpoint is step 8
    ckpt.close()
    assert ckpt.all_steps() == [4, 8]

    dp, state, loader = make(4)
    ckpt = jddp.Checkpointer(tmp_path, save_every=4, max_to_keep=2)
    state, loader = ckpt.restore_or_init(state, loader)
    assert int(state.step) == 8 and loader.get_state()["position"] == 8
    state, consumed = train(dp, state, loader, 20, ckpt)
    ckpt.close()
    assert consumed == {s: consumed_ref[s] for s in range(9, 21)}
    for name, value in reference.items():
        np.testing.assert_array_equal(np.asarray(state.params[name]), value)
    assert ckpt.all_steps() == [16, 20]


def test_restore_onto_other_device_counts_continues_the_same_batches(tmp_path, uninterrupted):
    """Saved on 4 devices, restored on 2 and on 8: the same global batches, parameters within round-off."""
    reference, consumed_ref = uninterrupted
    dp, state, loader = make(4)
    with jddp.Checkpointer(tmp_path, save_every=6) as ckpt:
        train(dp, state, loader, 6, ckpt)
    for devices in (2, 8):
        dp, state, loader = make(devices)
        with jddp.Checkpointer(tmp_path) as ckpt:
            state, loader = ckpt.restore_or_init(state, loader)
            assert state.params["w1"].sharding.mesh.devices.size == devices
            assert int(state.step) == 6
            state, consumed = train(dp, state, loader, 20)
        assert consumed == {s: consumed_ref[s] for s in range(7, 21)}
        for name, value in reference.items():
            np.testing.assert_allclose(np.asarray(state.params[name]), value, rtol=0, atol=1e-6)


def dropout_loss_fn(params, model_state, batch, key):
    """``loss_fn`` with dropout: the loss depends on the step's key, so on the saved RNG."""
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    hidden = hidden * jax.random.bernoulli(key, 0.5, hidden.shape) * 2.0
    logits = hidden @ params["w2"]
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
    return loss, (model_state, {})


def test_resume_restores_the_rng_into_a_state_built_from_another_seed(tmp_path):
    """The run's key is part of the checkpoint: a relaunch that builds its state with another seed still
    continues the uninterrupted run bitwise (and that seed alone would have trained differently)."""

    dp = jddp.DataParallel(dropout_loss_fn, optax.adamw(1e-2), mesh=jddp.data_mesh(jax.devices()[:4]))

    def run(seed: int, until: int, ckpt=None):  # each run with the same engine: one compilation for the four
        _, state, loader = make(4)
        state = dp.init(jax.tree.map(np.asarray, state.params), rng=seed)
        if ckpt is not None:
            state, loader = ckpt.restore_or_init(state, loader)
        return train(dp, state, loader, until, ckpt)[0]

    reference = jax.tree.map(np.asarray, run(7, 12).params)
    other_seed = jax.tree.map(np.asarray, run(99, 12).params)
    assert not np.array_equal(other_seed["w1"], reference["w1"])  # the key matters to this loss
    with jddp.Checkpointer(tmp_path, save_every=5) as ckpt:
        run(7, 6, ckpt)
    with jddp.Checkpointer(tmp_path) as ckpt:
        resumed = run(99, 12, ckpt)
    for name, value in reference.items():
        np.testing.assert_array_equal(np.asarray(resumed.params[name]), value, err_msg=name)


def largest_data_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def truncate(step_dir: Path) -> None:
    path = largest_data_file(step_dir)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete_manifest(step_dir: Path) -> None:
    (step_dir / "state" / "manifest.ocdbt").unlink()


def flip_bytes(step_dir: Path) -> None:
    path = largest_data_file(step_dir)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + 8):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


# When a restore fails inside Orbax, tensorstore callbacks still pending later hit Orbax's closed event loop
# ("Event loop is closed", ignored in a background thread): noise of the failure path, not of jddp.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", [truncate, delete_manifest, flip_bytes], ids=lambda f: f.__name__)
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    dp, state, loader = make(4, hidden=256)  # chunks large enough that the damage lands inside array data
    with jddp.Checkpointer(tmp_path, save_every=3) as ckpt:
        saved, _ = train(dp, state, loader, 9, ckpt)
        assert ckpt.all_steps() == [3, 6, 9]
    damage(tmp_path / "9")

    dp, state, loader = make(4, hidden=256)
    ckpt = jddp.Checkpointer(tmp_path, save_every=3)
    with pytest.warns(jddp.CheckpointWarning, match=r"Checkpoint step 9 in .* cannot be used \(") as caught:
        state, loader = ckpt.restore_or_init(state, loader)
    reason = str(caught[0].message)
    if damage is flip_bytes:
        assert "digest mismatch" in reason or "restore failed" in reason
    assert int(state.step) == 6 and loader.get_state()["position"] == 6
    assert (tmp_path / "9.damaged").is_dir() and ckpt.all_steps() == [3, 6]
    state, _ = train(dp, state, loader, 9, ckpt)  # step 9 can be saved again
    ckpt.close()
    assert ckpt.all_steps() == [3, 6, 9]
    np.testing.assert_array_equal(np.asarray(state.params["w1"]), np.asarray(saved.params["w1"]))
    gc.collect()  # collect Orbax's failed-restore leftovers here, under this test's filter, not in a later test


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # as above
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_every_checkpoint_damaged_starts_afresh_with_a_warning_and_keeps_them(tmp_path, uninterrupted):
    """No crash (a relaunch would crash again or start afresh anyway), nothing deleted, said loudly."""
    reference, consumed_ref = uninterrupted
    dp, state, loader = make(4)
    with jddp.Checkpointer(tmp_path, save_every=3) as ckpt:
        train(dp, state, loader, 6, ckpt)
        assert ckpt.all_steps() == [3, 6]
    delete_manifest(tmp_path / "6")
    (tmp_path / "3" / "meta" / "metadata").write_text('{"step": 3, "lea')  # a torn metadata file

    dp, state, loader = make(4)
    ckpt = jddp.Checkpointer(tmp_path, save_every=3)
    with pytest.warns(jddp.CheckpointWarning) as caught:
        state, loader = ckpt.restore_or_init(state, loader)
    messages = [str(w.message) for w in caught]
    assert messages[0].startswith("Checkpoint step 6 in") and "restore failed" in messages[0]
    assert messages[1].startswith("Checkpoint step 3 in") and "metadata cannot be read" in messages[1]
    assert re.match(
        r"No checkpoint in .* can be loaded \(step 6: restore failed.*; step 3: its metadata cannot be read.*\)\. "
        r"They are kept as <step>\.damaged; training starts again from the state passed in, at step 0\.",
        messages[2],
    ), messages[2]
    assert [step for step, _ in ckpt.damaged] == [6, 3]
    assert int(state.step) == 0 and loader.get_state()["position"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3.damaged", "6.damaged", "jddp.lease", "jddp.run"]
    assert (tmp_path / "6.damaged" / "state").is_dir()  # the data is still there, for inspection or repair
    state, consumed = train(dp, state, loader, 20, ckpt)  # a fresh run: the uninterrupted sequence from step 1
    ckpt.close()
    assert consumed == consumed_ref
    for name, value in reference.items():
        np.testing.assert_array_equal(np.asarray(state.params[name]), value)
    assert ckpt.all_steps() == [12, 15, 18]  # max_to_keep=3
    assert (tmp_path / "3.damaged").is_dir() and (tmp_path / "6.damaged").is_dir()  # retention leaves them alone
    gc.collect()  # as above


@pytest.mark.multiprocess  # starts a process of its own
def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint(tmp_path):
    """A process SIGKILLs itself while its async save of a 64 MB state is being written."""
    code = f"""
import os, signal, time, numpy as np, optax, jax, jax.numpy as jnp
import jddp
dp = jddp.DataParallel(lambda p, s, b, r: (jnp.mean(b["x"]) * jnp.sum(p["w"]), (s, {{}})), optax.sgd(0.1),
                       mesh=jddp.data_mesh())
state = dp.init({{"w": np.ones((4096, 4096), np.float32)}})
ckpt = jddp.Checkpointer({str(tmp_path)!r})
ckpt.save(state, wait=True)                        # step 0, complete
state, _ = dp.step(state, {{"x": np.ones((8, 2), np.float32)}})
ckpt.save(state)                                    # step 1, written in the background
root = {str(tmp_path)!r}
deadline = time.monotonic() + 60
while not any("tmp" in name for name in os.listdir(root)) and time.monotonic() < deadline:
    time.sleep(0.001)                               # until the write of step 1 has begun
os.kill(os.getpid(), signal.SIGKILL)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], env=multiprocess.environment(), capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if "tmp" in p.name]
    assert leftovers, "the kill should have interrupted the write of step 1"
    dp = jddp.DataParallel(
        lambda p, s, b, r: (jnp.mean(b["x"]) * jnp.sum(p["w"]), (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh()
    )
    state = dp.init({"w": np.zeros((4096, 4096), np.float32)})
    with jddp.Checkpointer(tmp_path) as ckpt:
        state = ckpt.restore_or_init(state)
    assert int(state.step) == 0 and float(state.params["w"][0, 0]) == 1.0
    assert not [p.name for p in tmp_path.iterdir() if "tmp" in p.name]  # cleaned when the directory was opened


# ------------------------------------------------------------------ the async write beside training


def _sum_loss(params, model_state, batch, key):
    """Every parameter's gradient is mean(x): each step changes every byte; a key in the model state is split."""
    loss = jnp.mean(batch["x"]) * sum(jnp.sum(v) for v in jax.tree.leaves(params))
    if model_state:
        model_state = {"key": jax.random.split(model_state["key"][0], model_state["key"].shape[0])}
    return loss, (model_state, {})


@pytest.mark.parametrize("typed_key", [False, True], ids=["arrays", "with-a-typed-key"])
def test_each_checkpoint_is_the_state_at_its_step_while_later_steps_donate(tmp_path, typed_key):
    """Saves in a row, each followed at once by donating steps; every checkpoint restores bitwise as saved.

    The writer thread reads the buffers while the next steps run: a buffer it
    reads must not be donated (a typed PRNG key once was, through a copy that
    shared its buffer, and its write failed with "Array has been deleted").
    """
    dp = jddp.DataParallel(_sum_loss, optax.sgd(0.5), mesh=jddp.data_mesh(jax.devices()[:4]))
    params = {f"w{i}": np.random.default_rng(i).normal(size=(2**21,)).astype(np.float32) for i in range(3)}

    def fresh():
        state = dp.init(params)
        if not typed_key:
            return state
        keys = jax.device_put(jax.random.split(jax.random.key(3), 64), state.params["w0"].sharding)
        return dataclasses.replace(state, model_state={"key": keys})

    def host_copy(state):
        model_state = jax.tree.map(lambda k: np.array(jax.random.key_data(k)), state.model_state)
        return jax.tree.map(np.array, state.params), model_state

    state, batch, expected = fresh(), {"x": np.ones((16, 2), np.float32)}, {}
    with jddp.Checkpointer(tmp_path, max_to_keep=None) as ckpt:
        for _ in range(3):
            expected[int(state.step)] = host_copy(state)
            ckpt.save(state)
            for _ in range(3):
                state, _ = dp.step(state, batch)  # donates the state just saved
    assert sorted(expected) == [0, 3, 6]
    for step in (6, 3, 0):
        with jddp.Checkpointer(tmp_path) as ckpt:
            restored = ckpt.restore_or_init(fresh())
        assert int(restored.step) == step
        for got, want in zip(jax.tree.leaves(host_copy(restored)), jax.tree.leaves(expected[step]), strict=True):
            np.testing.assert_array_equal(got, want, err_msg=f"step {step}")
        shutil.rmtree(tmp_path / str(step))  # the next older one is the newest now


DISK_FULL = """
import os, shutil, sys, numpy as np, optax, jax, jax.numpy as jnp
import jddp
root = sys.argv[1]
dp = jddp.DataParallel(lambda p, s, b, r: (jnp.mean(b["x"]) * jnp.sum(p["w"]), (s, {})), optax.sgd(0.1),
                       mesh=jddp.data_mesh())
w0 = np.random.default_rng(0).normal(size=(512, 512)).astype(np.float32)  # 1 MiB that does not compress
x = {"x": np.ones((8, 2), np.float32)}
for then in ("save", "wait", "close"):
    directory = f"{root}/{then}"
    state = dp.init({"w": w0})
    ckpt = jddp.Checkpointer(directory)
    ckpt.save(state, wait=True)  # step 0 fits
    with open(f"{root}/filler", "wb") as f:
        f.write(os.urandom(1 << 20))  # now the next step does not
    state, _ = dp.step(state, x)
    assert ckpt.save(state) == 1  # returns: step 1 fails in the background
    try:
        if then == "save":  # the next save raises if the write has failed by then, else the one after
            for _ in range(2):
                state, _ = dp.step(state, x)
                ckpt.save(state)
        else:
            getattr(ckpt, then)()
        print(then, "RAISED NOTHING")
    except Exception as error:
        # The OS's ENOSPC text, or jddp's diagnosis of it when Orbax's background failure surfaces as another error
        # (under load, its event loop may close first: "Event loop is closed").
        text = str(error)
        print(then, "raised", type(error).__name__, "no space" in text.lower() or "The disk is full" in text)
        print(then, "says", text.split("(")[0], "The disk is full" in text, "step 0, is intact" in text)
    print(then, "published", ckpt.all_steps())
    os.remove(f"{root}/filler")
    if then == "close":
        ckpt = jddp.Checkpointer(directory)
    ckpt.save(state, wait=True)  # the retry writes the step
    ckpt.close()
    with jddp.Checkpointer(directory) as again:
        restored = again.restore_or_init(dp.init({"w": np.zeros_like(w0)}))
    same = np.array_equal(np.asarray(restored.params["w"]), np.asarray(state.params["w"]))
    print(then, "restored step", int(restored.step), int(restored.step) == int(state.step) and same)
    shutil.rmtree(directory)  # room for the next case
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a tmpfs")
@pytest.mark.multiprocess  # starts a process of its own
def test_a_disk_full_in_the_background_write_surfaces_once_and_a_retry_writes_the_step(tmp_path):
    """A real fault: a 2.5 MiB tmpfs (in a private mount namespace) fills up while step 1 is written.

    The error is raised by the next ``wait`` or ``close``, or by a later ``save`` (the next one if the
    write has failed by then, else the one after: its hand-over waits for the failed write), and only
    once; only step 0 is published; after space is freed, saving again writes the step.
    """
    (tmp_path / "full.py").write_text(DISK_FULL)
    fs = tmp_path / "fs"
    mount = f"mount -t tmpfs -o size=2500k jddp-full {fs} && exec {sys.executable} {tmp_path}/full.py {fs}"
    (tmp_path / "fs").mkdir()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", mount],
        env=multiprocess.environment(JDDP_LOCAL_DEVICES="4"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "ERROR:absl" not in done.stderr, done.stderr[-3000:]  # Orbax's own logs of it: the error says it once
    lines = done.stdout.splitlines()
    for then in ("save", "wait", "close"):
        assert f"{then} raised CheckpointError True" in lines, done.stdout + done.stderr[-3000:]  # Orbax's ENOSPC
        failed = "step 1" if then != "save" else "step (1|1 and step 2|2)"  # the next save, or the one after
        assert any(
            re.fullmatch(rf"{then} says Writing {failed} to checkpoint directory '.*/{then}' failed  True True", x)
            for x in lines
        ), done.stdout
        assert f"{then} published [0]" in lines, done.stdout
        assert f"{then} restored step {3 if then == 'save' else 1} True" in lines, done.stdout


def test_close_restores_sigterm_and_forgets_a_notice_it_acted_on(tmp_path):
    """After the last Checkpointer closes, SIGTERM kills again and an old notice does not preempt a new one."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    dp, state, loader = make(2)
    first = jddp.Checkpointer(tmp_path / "a", exit_on_preemption=False)
    second = jddp.Checkpointer(tmp_path / "b")
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    os.kill(os.getpid(), signal.SIGTERM)  # caught: the test goes on
    state, _ = train(dp, state, loader, 1)
    assert first.maybe_save(state, loader) and first.preempted and first.all_steps() == [1]
    second.close()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # `first` is still open
    first.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with jddp.Checkpointer(tmp_path / "c", save_every=100) as third:
        state, _ = train(dp, state, loader, 4, third)  # maybe_save each step: no stale preemption
        assert not third.preempted and third.all_steps() == []


# ------------------------------------------------------------------ errors


def test_a_directory_that_is_a_file_or_inside_one_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(NotADirectoryError, match=r"Checkpoint directory '.*/a_file' is a file\. Pass a directory"):
        jddp.Checkpointer(blocker)
    with pytest.raises(NotADirectoryError, match=r"Checkpoint directory '.*a_file/ckpt' is inside '.*/a_file', which"):
        jddp.Checkpointer(blocker / "ckpt")
    assert blocker.read_text() == "not a directory" and sorted(tmp_path.iterdir()) == [blocker]


def test_unwritable_directory_is_a_clear_error():
    # /sys refuses new directories to every user, root included (a chmod would not stop root).
    with pytest.raises(PermissionError, match=r"Checkpoint directory '/sys/jddp-ckpt' is not writable by process 0"):
        jddp.Checkpointer("/sys/jddp-ckpt")


def test_checkpoint_of_another_model_names_the_leaf(tmp_path):
    _, state, loader = make(2, hidden=32)
    with jddp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, loader)
    _, state, loader = make(2, hidden=48)
    with jddp.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"another model: its leaf \['params'\]\['w1'\] has shape \(16, 32\)"):
            ckpt.restore_or_init(state, loader)


def with_optimizer(optimizer):
    mesh = jddp.data_mesh(jax.devices()[:2])
    params = {"w1": np.ones((16, 8), np.float32), "w2": np.ones((8, 4), np.float32)}
    return jddp.DataParallel(loss_fn, optimizer, mesh=mesh).init(params)


@pytest.mark.parametrize(
    ("saved", "restored", "said"),
    [
        # The same arrays, another tree: only the empty nodes (optax's EmptyState) tell them apart.
        (optax.adam(1e-3), optax.adamw(1e-3), r"the same arrays, but its tree differs .* empty node \['opt_state'\]"),
        (optax.sgd(1e-2), optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2)), r"empty node"),
        # Other arrays: named by path, not by position in the flattened state.
        (optax.adam(1e-3), optax.sgd(1e-2, momentum=0.9), r"\['opt_state'\]\[0\]\.count is saved but not here"),
        (optax.adam(1e-3), optax.chain(optax.add_noise(0.1, 0.5, 0), optax.adam(1e-3)), r"leaves"),
    ],
    ids=["adam-adamw", "sgd-clipped", "adam-momentum", "noise-added"],
)
def test_a_changed_optimizer_is_an_error_naming_it_and_the_checkpoint_is_kept(tmp_path, saved, restored, said):
    """A checkpoint of another optimizer is the user's change, not damage: a ValueError that says so, and the step
    stays where it is (before: Orbax's structure error was taken for damage, the step set aside, training
    restarted from step 0)."""
    with jddp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(with_optimizer(saved))
    before = sorted(os.listdir(tmp_path))
    with jddp.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=rf"holds another optimizer state: .*{said}.*The optimizer differs"):
            ckpt.restore_or_init(with_optimizer(restored))
    assert sorted(os.listdir(tmp_path)) == before and not any(".damaged" in f for f in before)


def test_a_checkpoint_saved_without_its_empty_nodes_is_still_refused_not_set_aside(tmp_path):
    """Checkpoints written before the structure was recorded: Orbax's own structure check is an error too."""
    with jddp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(with_optimizer(optax.adam(1e-3)))
    path = tmp_path / "0" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    del meta["empty_nodes"]
    path.write_text(json.dumps(meta))
    with jddp.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"Orbax finds the saved tree's structure different"):
            ckpt.restore_or_init(with_optimizer(optax.adamw(1e-3)))
    assert "0" in os.listdir(tmp_path) and not any(".damaged" in f for f in os.listdir(tmp_path))


NO_CLOSE = """
import sys
import threading
import time
import jddp
jddp.simulate_cpu_devices(2)
import numpy as np, optax
loss_fn = lambda p, ms, b, rng: (jddp.masked_mean((b["x"] @ p["w"] - b["y"]) ** 2, b.get("mask")), (ms, {}))
dp = jddp.DataParallel(loss_fn, optax.adam(1e-2), mesh=jddp.data_mesh())
state = dp.init({"w": np.zeros((1024, 512), np.float32)})
ckpt = jddp.Checkpointer(sys.argv[1])
for i in range(3):
    state, _ = dp.step(state, {"x": np.ones((4, 1024), np.float32), "y": np.ones((4, 512), np.float32)})
ckpt.save(state)
if sys.argv[2] == "raise":
    raise RuntimeError("the script fails after its save")
if sys.argv[2] == "dropped":  # a Checkpointer local to a function that returned: no reference of the script's left
    import gc
    if ckpt._pending is not None:
        ckpt._pending.result()  # handed to Orbax: jddp's writer thread holds the Checkpointer no more
    del ckpt
    gc.collect()
"""


def run_script(code: str, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python process of its own (jddp's exit hooks are the subject), its output captured."""
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=multiprocess.environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("how", ["returns", "raise", "dropped"])
@pytest.mark.multiprocess  # starts a process of its own
def test_a_script_that_ends_without_close_still_writes_its_last_save(tmp_path, how):
    """torch.save habits: ``save`` and the end of the script, no ``close``. The async save is finished at exit
    (said on stderr), the lease given back; before, the step was lost with the interpreter, silently. Alone (no
    group), an unhandled exception does not change that; nor does a Checkpointer the script no longer references
    (made in a function that returned: Equinox's train_rnn port lost its step-50 save so, under load)."""
    done = run_script(NO_CLOSE, str(tmp_path), how)
    assert done.returncode == (1 if how == "raise" else 0), done.stderr[-3000:]
    assert "ended without closing the Checkpointer" in done.stderr and "(step 3)" in done.stderr, done.stderr
    # the step and the run's id (jddp.run), and no lease left
    assert sorted(os.listdir(tmp_path)) == ["3", "jddp.run"], os.listdir(tmp_path)
    with jddp.Checkpointer(tmp_path, read_only=True) as ckpt:
        mesh = jddp.data_mesh(jax.devices()[:2])
        dp = jddp.DataParallel(lambda p, ms, b, r: (0.0, (ms, {})), optax.adam(1e-2), mesh=mesh)
        state = ckpt.restore_or_init(dp.init({"w": np.zeros((1024, 512), np.float32)}))
    assert int(state.step) == 3 and float(jnp.abs(state.params["w"]).sum()) > 0


LATE_SIGTERM = """
import atexit, os, signal, sys
import jddp
jddp.simulate_cpu_devices(2)
import numpy as np, optax
atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))  # a late SIGTERM: after jddp's exit hooks
loss_fn = lambda p, ms, b, rng: (jddp.masked_mean((b["x"] @ p["w"]) ** 2, b.get("mask")), (ms, {}))
dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
state = dp.init({"w": np.ones((3,), np.float32)})
ckpt = jddp.Checkpointer(sys.argv[1])


def train(ckpt):
    global state
    for step in range(100):
        state, _ = dp.step(state, {"x": np.ones((4, 3), np.float32)})
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        ckpt.maybe_save(state)


if sys.argv[2] == "with":
    with ckpt:
        train(ckpt)
else:
    train(ckpt)
"""


@pytest.mark.parametrize("how", ["with", "no-close"])
@pytest.mark.multiprocess  # starts a process of its own
def test_a_preempted_process_exits_75_even_if_another_sigterm_comes_during_its_exit(tmp_path, how):
    """After the preemption save the process exits 75, closing its Checkpointer on the way (a ``with`` block, or
    jddp's exit hook): a second SIGTERM then (a launcher's forward, a scheduler's repeat) must not turn 75 into a
    kill by the signal. Seen in the suite under load as `killed by SIGTERM` after `exit 75`."""
    done = run_script(LATE_SIGTERM, str(tmp_path), how)
    assert done.returncode == exitcodes.EXIT_PREEMPTED, done.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["3", "jddp.run"]


def test_steps_seen_published_are_no_longer_listed_as_unconfirmed(tmp_path):
    """A failed write's error names the steps not known written; a long run without ``wait()`` used to keep every
    step it had saved in that list, and the error listed steps that retention had deleted after publishing."""
    dp, state, loader = make(2)
    with jddp.Checkpointer(tmp_path, save_every=1, max_to_keep=2) as ckpt:
        train(dp, state, loader, 12, ckpt)
        assert ckpt.all_steps()[-1] >= 11  # retention ran: the early steps are gone from the directory
        assert len(ckpt._unconfirmed) <= 2 and ckpt._unconfirmed[-1] == 12, ckpt._unconfirmed


def test_config_change_is_an_error_unless_allowed(tmp_path):
    _, state, loader = make(2)
    with jddp.Checkpointer(tmp_path, config={"lr": 0.01, "batch": 16}) as ckpt:
        ckpt.save(state, loader)
    with jddp.Checkpointer(tmp_path, config={"lr": 0.02, "batch": 16}) as ckpt:
        with pytest.raises(ValueError, match=r"saved with another config \(lr: 0.01 -> 0.02\)"):
            ckpt.restore_or_init(state, loader)
    with jddp.Checkpointer(tmp_path, config={"lr": 0.02, "batch": 16}, allow_config_change=True) as ckpt:
        with pytest.warns(jddp.CheckpointWarning, match="another config"):
            ckpt.restore_or_init(state, loader)


@dataclasses.dataclass(frozen=True)
class _Model:
    hidden: int = 32
    devices: int = jddp.config.run_field(0)


@dataclasses.dataclass(frozen=True)
class _Run:
    lr: float = 0.01
    log_dir: str = jddp.config.run_field("runs/a")
    model: _Model = dataclasses.field(default_factory=_Model)


def test_run_fields_are_not_part_of_the_config_fingerprint(tmp_path):
    moved = _Run(log_dir="elsewhere", model=_Model(devices=8))
    assert config_fingerprint(moved) == config_fingerprint(_Run())
    assert config_fingerprint(moved)[1] == {"lr": 0.01, "model": {"hidden": 32}}
    assert config_fingerprint(_Run(model=_Model(hidden=64)))[0] != config_fingerprint(_Run())[0]
    _, state, loader = make(2)
    with jddp.Checkpointer(tmp_path, config=_Run()) as ckpt:
        ckpt.save(state, loader)
    with jddp.Checkpointer(tmp_path, config=moved) as ckpt:  # other devices and log directory: resumes
        assert int(ckpt.restore_or_init(state, loader)[0].step) == int(state.step)
    with jddp.Checkpointer(tmp_path, config=_Run(lr=0.02)) as ckpt:
        with pytest.raises(ValueError, match=r"another config \(lr: 0.01 -> 0.02\)"):
            ckpt.restore_or_init(state, loader)


def test_bad_options_are_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"`save_every` must be an int >= 1 or None, got save_every=0"):
        jddp.Checkpointer(tmp_path, save_every=0)
    with pytest.raises(ValueError, match=r"`max_to_keep` must be an int >= 1 or None, got max_to_keep=-1"):
        jddp.Checkpointer(tmp_path, max_to_keep=-1)
    for bad in (-1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match=r"`preemption_check_s` must be a finite number >= 0, got "):
            jddp.Checkpointer(tmp_path, preemption_check_s=bad)


def test_digest_sees_a_one_bit_change():
    from jddp.checkpoint import state_digests

    x = np.arange(1000, dtype=np.float32)
    y = x.copy()
    y.view(np.uint32)[500] ^= 1
    assert state_digests([jnp.asarray(x)]) != state_digests([jnp.asarray(y)])
    assert state_digests([jnp.asarray(x)]) == state_digests([jnp.asarray(x.copy())])


# ------------------------------------------------------------------ several processes under the launcher


def read_consumed(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# Past every step the tests act at (kills up to step 13, a save every 4 steps: 4, 8, 12 and 16 on disk); more steps
# run the same code again.
TWO_PROCESS_STEPS = 16


def launch_worker(
    out: Path, *args: str, restarts: int = 3, steps: int = TWO_PROCESS_STEPS, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The checkpointing worker under ``jddp launch -n 2 --max-restarts <restarts>`` for ``steps`` steps.

    A run that must not fail gets no restart (0): a failure then shows instead of being restarted, and no spare or
    standby processes start beside it for a restart that never comes (each imports JAX and compiles the step: two
    more processes on the CPUs the run uses). A run that fails N times gets N: no spares for an attempt N + 1."""
    out.mkdir(exist_ok=True)
    return multiprocess.launch(
        # The launcher sees a worker die itself; the peer timeout only matters for a live process that goes silent,
        # and a short one judged a slow process dead on a loaded machine.
        *("-n", "2", "--max-restarts", str(restarts), "--kill-grace", "1", "--peer-timeout", "15"),
        *("--term-timeout", "60", WORKER, str(out), str(steps), *args),
        env=env,
    )


@pytest.fixture(scope="module")
def two_process_reference(tmp_path_factory):
    """An uninterrupted 2-process run: the ids each step consumed, and the final parameters."""
    return reference_run(tmp_path_factory)


def reference_run(tmp_path_factory):
    """``two_process_reference``'s run, for other modules' fixtures."""
    out = tmp_path_factory.mktemp("clean")
    done = launch_worker(out, restarts=0)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    reference = {r["step"]: r["ids"] for r in read_consumed(out / "consumed.jsonl")}
    assert sorted(reference) == list(range(1, TWO_PROCESS_STEPS + 1))
    return reference, dict(np.load(out / "final.npz"))


def assert_same_run(out: Path, reference, context: str = "") -> list[dict]:
    """Every step of every attempt consumed the reference's examples, and the final parameters are bitwise equal."""
    consumed, params = reference
    log = read_consumed(out / "consumed.jsonl")
    for record in log:
        assert record["ids"] == consumed[record["step"]], (record["attempt"], record["step"], context)
    final = np.load(out / "final.npz")
    assert sorted(final.files) == sorted(params)
    for name, value in params.items():
        np.testing.assert_array_equal(final[name], value, err_msg=f"{name} {context}")
    return log


@pytest.mark.multiprocess  # its reference is the module's 2-process run
def test_sigterm_saves_exits_75_and_the_rerun_ends_bitwise_equal(tmp_path, two_process_reference):
    """One process: SIGTERM after step 7; the save is step 7; the rerun finishes like an uninterrupted run. That run
    is the module's 2-process one: 1 process of 2 devices trains bitwise as 2 processes of 1 (a sum of two)."""
    env = multiprocess.environment(JDDP_LOCAL_DEVICES="2")
    steps = str(TWO_PROCESS_STEPS)
    done = subprocess.run(
        [sys.executable, WORKER, str(tmp_path), steps], env={**env, "TERM_AT": "7"}, capture_output=True, text=True
    )
    assert done.returncode == exitcodes.EXIT_PREEMPTED, done.stderr
    assert sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())[-1] == 7
    done = subprocess.run([sys.executable, WORKER, str(tmp_path), steps], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "RESUMED at step 7" in done.stdout
    assert_same_run(tmp_path, two_process_reference, "one process, SIGTERM at 7")


@pytest.mark.multiprocess
def test_two_processes_killed_twice_resume_bitwise_equal(tmp_path, two_process_reference):
    """jddp launch --max-restarts 2; process 1 SIGKILLs itself at two random steps (before its maybe_save there).
    Each restart restores from memory: process 1 keeps no snapshot of the replicated state (its host's first process
    does), so process 0's newest is sent to it ("peer"): the kill's step (if process 0 finished it), or one or two
    before; the disk (a save every 4 steps) only when its step is newer."""
    rng, named = replay.rng()
    kills = sorted(int(k) for k in rng.choice(np.arange(5, TWO_PROCESS_STEPS - 2), 2, replace=False))
    memory = {"JDDP_SNAPSHOT_DIR": str(tmp_path / "memory")}
    done = launch_worker(tmp_path, f"{kills[0]},{kills[1]}", restarts=2, env=memory)
    shown = f"kills at {kills}, {named}\n{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, shown
    log = assert_same_run(tmp_path, two_process_reference, f"kills at {kills}, {named}")
    assert {r["attempt"] for r in log} == {0, 1, 2}, f"kills at {kills}, {named}"
    resumed = [
        (int(s), int(a), f) for s, a, f in re.findall(r"RESUMED at step (\d+) attempt (\d) from (\w+)", done.stdout)
    ]
    assert [a for _, a, _ in resumed] == [0, 1, 2] and resumed[0][2] == "None", shown
    for (step, _, source), kill in zip(resumed[1:], kills, strict=True):
        disk = (kill - 1) // 4 * 4  # the newest save before the kill (the one at the kill's step is never made)
        assert max(kill - 2, disk) <= step <= kill, shown
        # the disk only when newer than every snapshot (>= kill - 2): its save at kill - 1
        assert source == "peer" or (source == "disk" and step == disk == kill - 1), shown


def launch_killed_once_when(
    tmp_path: Path, said_when: Callable[[str], bool], *flags: str, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """The checkpointing worker under ``jddp launch -n 2 --max-restarts 3 *flags``, process 1 SIGKILLing itself after
    step 9 once a launcher line satisfies ``said_when`` (``KILL_ONCE``); returns the exit code, what the processes
    printed and what the launcher said. ``env``: more of the worker's settings."""
    ready = tmp_path / "said"
    env = {"JDDP_SNAPSHOT_DIR": str(tmp_path / "memory"), "KILL_ONCE": f"9:{ready}", **(env or {})}
    (tmp_path / "run").mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", "3", *flags, "--peer-timeout", "15",
         WORKER, str(tmp_path / "run"), str(TWO_PROCESS_STEPS)],
        env=multiprocess.environment(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=multiprocess.ROOT,
    )  # fmt: skip
    said: list[str] = []
    printed: list[str] = []

    def read(pipe, lines: list[str]) -> None:
        for line in pipe:
            lines.append(line)
            if said_when(line):
                ready.touch()

    readers = [
        threading.Thread(target=read, args=(pipe, lines), daemon=True)
        for pipe, lines in ((launcher.stderr, said), (launcher.stdout, printed))
    ]
    multiprocess.wait_read(launcher, readers, 240)
    return launcher.returncode, "".join(printed), "".join(said)


@pytest.mark.multiprocess
def test_a_restart_handed_to_spares_forked_from_the_zygote_resumes_bitwise_equal(tmp_path, two_process_reference):
    """``--no-standby``: process 1 SIGKILLs itself after step 9 once the launcher says its spares are ready, forked
    from the zygote (``jddp.cli.zygote``); the restart hands them their roles, they run the script (its imports
    done in the zygote), restore from memory and end the run bitwise equal to the uninterrupted one, exit codes
    and output as any process's."""
    code, out, said = launch_killed_once_when(
        tmp_path, lambda line: launch_lib.SPARES_READY in line and launch_lib.FORKED in line, "--no-standby"
    )
    shown = out + said
    assert code == 0, shown
    assert re.search(r"process\(es\) 0 \(pid \d+\), 1 \(pid \d+\) handed to their spares", shown), shown
    assert_same_run(tmp_path / "run", two_process_reference, "handed to forked spares")
    resumed = re.findall(r"^\[0\] RESUMED at step (\d+) attempt (\d) from (\w+)$", out, re.MULTILINE)
    assert resumed[0] == ("0", "0", "None") and len(resumed) == 2, shown
    assert 8 <= int(resumed[1][0]) <= 9 and resumed[1][1:] == ("1", "peer"), shown
    assert len(re.findall(r"^\[1\] jddp: process 1 of 2", out + said, re.MULTILINE)) == 2, shown


@pytest.mark.multiprocess
def test_a_restart_woken_from_standby_resumes_bitwise_equal(tmp_path, two_process_reference):
    """Process 1 SIGKILLs itself after step 9 once the launcher says its standby processes stand by: the restart
    wakes them (no process started), they restore from memory (process 0's snapshot sent to process 1: the kill's
    step, or one before), and the run ends bitwise equal to the uninterrupted one; what the standby processes printed
    before they were woken comes out after, prefixed as any process's; the standby processes of the next attempt
    (never woken) print nothing."""
    code, out, said = launch_killed_once_when(tmp_path, lambda line: launch_lib.STANDBY_READY in line)
    shown = out + said
    assert code == 0, shown
    assert re.search(r"process\(es\) 0 \(pid \d+\), 1 \(pid \d+\) woken from standby", shown), shown
    assert "handed to their spares" not in shown and "starting the processes anew" not in shown, shown
    assert_same_run(tmp_path / "run", two_process_reference, "woken from standby")
    resumed = re.findall(r"^\[0\] RESUMED at step (\d+) attempt (\d) from (\w+)$", out, re.MULTILINE)
    assert resumed[0] == ("0", "0", "None") and len(resumed) == 2, shown
    assert 8 <= int(resumed[1][0]) <= 9 and resumed[1][1:] == ("1", "peer"), shown
    # the woken processes' first lines (jddp.initialize's, printed in standby) came out, prefixed
    assert len(re.findall(r"^\[1\] jddp: process 1 of 2", out + said, re.MULTILINE)) == 2, shown
    assert not [line for line in out.splitlines() if not line.startswith(("[0] ", "[1] "))], out


@pytest.mark.multiprocess
def test_an_exception_while_an_async_save_is_written_exits_1_and_the_restart_resumes_bitwise_equal(
    tmp_path, two_process_reference
):
    """Process 0 raises right after handing over the save of step 8. Its peer exits 69; process 0 must exit 1 by
    itself, not wait at exit for Orbax's commit thread, which waits at a barrier for the peer that left (before:
    the launcher had to SIGKILL it, and named it frozen). The restart resumes from the last complete step."""
    done = launch_worker(tmp_path, restarts=1, env={"RAISE_AT": "8"})
    shown = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0, shown
    assert "first failure: process 0, failed with exit code 1" in done.stderr, shown
    assert "did not end with the group" not in done.stderr, shown
    log = assert_same_run(tmp_path, two_process_reference, "raise at 8")
    assert {r["attempt"] for r in log} == {0, 1}


@pytest.mark.multiprocess
@pytest.mark.parametrize("target", ["launcher", "self"], ids=["to-the-launcher", "to-process-1-only"])
def test_two_processes_sigterm_save_the_agreed_step_and_resume_bitwise_equal(tmp_path, two_process_reference, target):
    """SIGTERM after step 8, to the launcher (forwarded to both) or to process 1 alone: both stop at one step."""
    env = {"TERM_AT": "8", "TERM_TO": target, "PREEMPTION_CHECK_S": "0"}  # every step is a check
    done = launch_worker(tmp_path, env=env)
    shown = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == exitcodes.EXIT_PREEMPTED, shown
    stops = sorted(line.split("] ", 1)[1] for line in done.stdout.splitlines() if "PREEMPTED process" in line)
    assert len(stops) == 2, shown
    step = int(stops[0].split(" at step ")[1].split(",")[0])
    assert stops == [f"PREEMPTED process {i} at step {step}, exit {exitcodes.EXIT_PREEMPTED}" for i in (0, 1)]
    assert step == 8, shown  # the notice is in the exchange at the step it arrived
    saved = sorted(int(p.name) for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit())
    assert saved[-1] == step, saved  # the step the group stopped at is saved: no work lost
    assert max(r["step"] for r in read_consumed(tmp_path / "consumed.jsonl")) == step

    done = launch_worker(tmp_path, restarts=0)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert f"RESUMED at step {step} attempt 0" in done.stdout
    log = assert_same_run(tmp_path, two_process_reference)
    assert [r["step"] for r in log] == list(range(1, TWO_PROCESS_STEPS + 1))  # continues exactly, nothing repeated


@pytest.mark.multiprocess
def test_a_launcher_killed_mid_run_ends_its_processes_and_leaves_no_temporary_folder(tmp_path):
    """``jddp launch`` SIGKILLed after step 8: its orphan watcher (``jddp.cli.launch.orphans``) ends every process it
    started within a second (they do not run on unwatched: before, they took the preemption path and saved one more
    step) and removes the launcher's temporary folder, which nobody else can then (an unfinished write stays Orbax's
    ``.orbax-checkpoint-tmp``, which the next run's manager cleans up)."""
    env = {"KILL_LAUNCHER_AT": "8", "PREEMPTION_CHECK_S": "0"}
    done = launch_worker(tmp_path, steps=30, env=env)
    killed_at = time.monotonic()
    assert done.returncode == -signal.SIGKILL, f"{done.stdout}\n{done.stderr}"
    folders = {Path((tmp_path / f"launch-folder-{p}").read_text()) for p in (0, 1)}
    assert len(folders) == 1 and next(iter(folders)).name.startswith("jddp-launch-")
    while any(f.exists() for f in folders) and time.monotonic() - killed_at < 60:
        time.sleep(0.2)
    assert not any(f.exists() for f in folders), folders
    time.sleep(5)  # a process that ran on would reach its exit (or its preemption save) by now
    assert not [p for p in (0, 1) if (tmp_path / f"exit-{p}").exists()], "a process ran on after its launcher died"


def run_worker(out: Path, steps: int, devices: int) -> subprocess.CompletedProcess:
    """The checkpointing worker alone (one process with ``devices`` simulated devices)."""
    return subprocess.run(
        [sys.executable, WORKER, str(out), str(steps)],
        env=multiprocess.environment(JDDP_LOCAL_DEVICES=str(devices)),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.multiprocess
def test_saved_by_two_processes_restored_by_one(tmp_path, two_process_reference):
    """Saved at step 8 by 2 processes of 2 devices each, restored by 1 process of 2 devices, which ends the run: the
    uninterrupted run's batches at every step, and its parameters within round-off (that run is another topology
    still, 2 processes of 1 device: the module's reference)."""
    out = tmp_path / "two"
    out.mkdir()
    done = multiprocess.launch("-n", "2", "--devices-per-process", "2", WORKER, str(out), "8")
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_worker(out, TWO_PROCESS_STEPS, devices=2)
    assert done.returncode == 0, done.stderr
    assert "RESUMED at step 8 attempt 0 from disk" in done.stdout, done.stdout
    consumed, params = two_process_reference
    final = np.load(out / "final.npz")
    assert sorted(final.files) == sorted(params)
    for name, value in params.items():
        np.testing.assert_allclose(final[name], value, rtol=0, atol=1e-6, err_msg=name)
    log = read_consumed(out / "consumed.jsonl")
    assert [r["step"] for r in log] == list(range(1, TWO_PROCESS_STEPS + 1))
    for record in log:
        assert record["ids"] == consumed[record["step"]], record["step"]
