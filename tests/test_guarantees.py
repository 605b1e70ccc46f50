"""Documented guarantees, each pinned down by a test seen failing against a semantic mutant (tests/semantic_mutants.py
names it). Most of these mutants survived the rest of the suite; three did not (the unbounded dispatcher crashes
test_engine.py's 400 steps, the kept tmp directories and the unread SIGTERM fail test_checkpoint.py tests), and their
tests here check the guarantee directly.

Run as a script (``python tests/test_guarantees.py replicas``) this file is the worker of the two-process test:
it applies ``$JDDP_SEMANTIC_MUTANT`` itself, since a mutant applied in pytest's process does not reach another.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.runtime import dispatch
from tests import multiprocess


def sqrt_loss(params, model_state, batch, rng):
    """A finite loss (0) whose gradient is infinite at w = 0: d/dw sqrt(w x) = x / (2 sqrt(w x))."""
    return jnp.mean(jnp.sqrt(params["w"] * batch["x"])), (model_state, {})


def square_loss(params, model_state, batch, rng):
    return jnp.mean((batch["x"] * params["w"][None, :] - 1.0) ** 2), (model_state, {})


def small_state(mesh):
    dp = jddp.DataParallel(square_loss, optax.sgd(0.1), mesh=mesh)
    return dp, dp.init({"w": np.ones((8,), np.float32)})


@pytest.fixture
def mesh():
    return jddp.data_mesh()


# ------------------------------------------------------------------------------------------------- engine


def test_a_finite_loss_with_an_infinite_gradient_skips_the_update(mesh):
    """engine.md: "a non-finite loss or gradient skips the update on every replica" (mutant
    nonfinite_checks_only_the_loss: the guard reads the loss only)."""
    dp = jddp.DataParallel(sqrt_loss, optax.sgd(0.1), mesh=mesh)
    state = dp.init({"w": np.float32(0.0)})
    state, m = dp.step(state, {"x": np.ones(16, np.float32)})
    assert float(m["loss"]) == 0.0 and not np.isfinite(float(m["grad_norm"]))
    assert float(m["nonfinite"]) == 1.0
    assert float(state.params["w"]) == 0.0  # not NaN: the update was skipped
    dp.check_replicas(state)


def test_the_dispatcher_keeps_at_most_max_inflight_steps_in_flight(mesh):
    """glossary.md: "one dispatcher that keeps at most `max_inflight` (2) steps ahead" (mutant
    dispatch_unbounded: it never waits). tests/test_engine.py's 400 steps kill that mutant too, by an abort of
    XLA:CPU that takes pytest's process with it; this test names the bound instead."""
    model_dp = jddp.DataParallel(square_loss, optax.sgd(0.01), mesh=mesh, max_inflight=2)
    state = model_dp.init({"w": np.ones((8,), np.float32)})
    batch = jax.device_put({"x": np.ones((64, 8), np.float32)}, jddp.batch_sharding(mesh))
    most = 0
    for _ in range(8):
        state, _ = model_dp.step(state, batch)
        most = max(most, len(dispatch.DISPATCHER._pending))
    assert most <= 2
    assert int(state.step) == 8


def test_evaluate_combines_batches_by_each_metrics_own_weight(mesh):
    """data.md: "every example once, padding masked: exact single-device metrics", for a ``Weighted`` metric
    over tokens whose count per example differs between batches (mutant evaluate_weights_by_examples: batches
    combined by their examples; tests/test_loader.py's weight is twice the examples, so it cannot tell)."""
    x = np.arange(50, dtype=np.float32)
    tokens = np.where(np.arange(50) < 32, 1.0, 10.0).astype(np.float32)  # later batches: 10 tokens an example

    def eval_fn(params, model_state, batch):
        real = batch["tokens"] * batch["mask"]
        return {"per_token": jddp.Weighted(jnp.sum(batch["x"] * real), jnp.sum(real))}

    dp = jddp.DataParallel(square_loss, optax.sgd(0.1), mesh=mesh, eval_fn=eval_fn)
    state = dp.init({"w": np.ones((8,), np.float32)})
    loader = jddp.data.DataLoader({"x": x, "tokens": tokens}, global_batch_size=16, shuffle=False, drop_last=False)
    metrics = dp.evaluate(state, loader)
    assert metrics["examples"] == 50
    assert metrics["per_token"] == pytest.approx(float((x * tokens).sum() / tokens.sum()), rel=1e-6)


# --------------------------------------------------------------------------------------------- checkpoints


def test_an_unfinished_save_is_not_published_and_is_cleaned_up(tmp_path, mesh):
    """checkpoint/__init__.py: "Leftover temporary directories are removed when a ``Checkpointer`` opens the
    directory." (mutant leftover_temporary_directories_kept)."""
    _, state = small_state(mesh)
    with jddp.Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, wait=True)
    leftover = tmp_path / "7.orbax-checkpoint-tmp-1700000000"  # a writer killed in the middle of step 7
    (leftover / "state").mkdir(parents=True)
    (leftover / "state" / "half_written").write_bytes(b"\0" * 100)
    with jddp.Checkpointer(tmp_path) as ckpt:
        assert ckpt.all_steps() == [0]
        restored = ckpt.restore_or_init(state)
        assert int(restored.step) == 0
    assert not leftover.exists(), sorted(p.name for p in tmp_path.iterdir())


def test_a_failed_write_is_raised_once_and_the_next_save_writes_the_step(tmp_path, mesh):
    """checkpoint/__init__.py: "The failed steps are not counted as saved: the next ``save`` writes the step
    again." (mutant failed_write_counted_as_saved). The fault is planted in Orbax's save, which runs in the
    background: ``save`` returns, the failure surfaces at ``wait``, and saving the same step again writes it."""
    _, state = small_state(mesh)
    with jddp.Checkpointer(tmp_path) as ckpt:

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        ckpt._manager.save = full  # this manager only: a failed write opens a new one
        ckpt.save(state)
        with pytest.raises(jddp.CheckpointError, match="No space left"):
            ckpt.wait()
        assert ckpt.all_steps() == []
        ckpt.save(state, wait=True)
        assert ckpt.all_steps() == [0]


def test_a_sigterm_saves_the_step_at_the_next_maybe_save(tmp_path, mesh):
    """checkpoint/__init__.py: "A single process stops at the next ``maybe_save``." (mutant
    sigterm_not_noticed). The Checkpointer catches the signal, so this process lives on."""
    dp, state = small_state(mesh)
    batch = {"x": np.ones((64, 8), np.float32)}
    with jddp.Checkpointer(tmp_path, save_every=100, exit_on_preemption=False) as ckpt:
        state, _ = dp.step(state, batch)
        assert ckpt.maybe_save(state) is False
        if not ckpt._preemption.installed:  # another SIGTERM handler (a test runner's): the signal is not ours
            pytest.skip("SIGTERM has a handler of the test runner here")
        os.kill(os.getpid(), signal.SIGTERM)
        state, _ = dp.step(state, batch)
        assert ckpt.maybe_save(state) is True and ckpt.preempted
        assert ckpt.all_steps() == [2]


def test_save_returns_while_the_write_is_still_running(tmp_path, mesh, monkeypatch):
    """checkpoint/__init__.py: "``save`` returns before the files are written; ``close`` waits." (mutant
    save_waits_for_the_write). Orbax's part of the write is held until save has returned."""
    _, state = small_state(mesh)
    release = threading.Event()
    original = jddp.Checkpointer._hand_over

    def held(self, *args):
        release.wait(120)
        return original(self, *args)

    monkeypatch.setattr(jddp.Checkpointer, "_hand_over", held)
    ckpt = jddp.Checkpointer(tmp_path)
    try:
        saver = threading.Thread(target=ckpt.save, args=(state,), daemon=True)
        saver.start()
        saver.join(30)
        returned = not saver.is_alive()
    finally:
        release.set()
        saver.join(120)
        ckpt.close()
    assert returned, "save waited for the write"
    assert (tmp_path / "0").is_dir()  # close waited for it


def test_maybe_save_counts_its_own_steps(tmp_path, mesh):
    """checkpoint/__init__.py: "``maybe_save`` decides from a step counter every process keeps the same way
    (call it once per step on every process)" (mutant save_decided_by_one_process: the counter re-read from
    each state). Called once per step, it saves every ``save_every`` calls, whatever the state says."""
    _, state = small_state(mesh)
    with jddp.Checkpointer(tmp_path, save_every=2) as ckpt:
        decisions = [ckpt.maybe_save(state) for _ in range(5)]  # the state never moves
    assert decisions == [True, False, True, False, True]


# ---------------------------------------------------------------------------------------- two processes


@pytest.mark.multiprocess
def test_init_replicates_process_0s_values_over_two_processes():
    """glossary.md: "`DDP(model)` (broadcasts rank 0's weights)" -> "`dp.init(params)` replicates" (mutant
    replicas_from_own_process). Each process passes its own values; every replica must hold process 0's."""
    outputs = multiprocess.run(__file__, 2, 2, "replicas", timeout=240)
    values = sorted(line for out in outputs for line in out.splitlines() if line.startswith("W "))
    assert values == ["W 0 1.0", "W 1 1.0"], outputs


def _replicas_worker() -> None:
    jddp.initialize()
    from tests import semantic_mutants

    semantic_mutants.apply_from_env()
    me = jax.process_index()
    dp = jddp.DataParallel(
        lambda p, s, b, r: (jnp.mean(b["x"] * p["w"]), (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh()
    )
    state = dp.init({"w": np.full((4,), me + 1.0, np.float32)})  # process 1 passes 2.0
    dp.check_replicas(state)
    print(f"W {me} {float(np.asarray(state.params['w'].addressable_shards[0].data)[0])}", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if sys.argv[1:] == ["replicas"]:
        _replicas_worker()
