"""Bad input: clear errors naming the value and the fix, raised before any state changes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from tests import models


@pytest.fixture(scope="module")
def setup():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
    return model, dp


def assert_state_intact(dp, state, model):
    """The failed call changed nothing: the state is alive and still steps."""
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    np.testing.assert_array_equal(np.asarray(state.params["w1"]), model.params["w1"])
    step = int(state.step)
    new_state, _ = dp.step(state, models.batch(64))
    assert int(new_state.step) == step + 1


def test_batch_not_divisible_by_devices(setup):
    model, dp = setup
    state = dp.init(model.params)
    with pytest.raises(ValueError, match=r"global_batch_size=60, devices=8, accumulate_steps=1.*multiple of 8"):
        dp.step(state, models.batch(60))
    assert_state_intact(dp, state, model)


def test_batch_not_divisible_with_accumulation(setup):
    model, _ = setup
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), accumulate_steps=3)
    state = dp.init(model.params)
    with pytest.raises(ValueError, match=r"global_batch_size=64, devices=8, accumulate_steps=3.*multiple of 24"):
        dp.step(state, models.batch(64))


def test_batch_leaves_with_different_leading_sizes(setup):
    model, dp = setup
    state = dp.init(model.params)
    b = models.batch(64)
    b["y"] = b["y"][:32]
    with pytest.raises(ValueError, match=r"same leading \(batch\) size.*\['x'\]: 64.*\['y'\]: 32"):
        dp.step(state, b)
    assert_state_intact(dp, state, model)


def test_non_scalar_loss(setup):
    model, _ = setup

    def loss_fn(params, model_state, batch, rng):
        return (batch["x"] @ params["w1"]).sum(-1), (model_state, {})

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
    state = dp.init(model.params)
    with pytest.raises(ValueError, match=r"loss returned by `loss_fn` must be a scalar.*shape=\(8,\).*masked_mean"):
        dp.step(state, models.batch(64))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_loss_fn_with_wrong_output_structure(setup):
    model, _ = setup
    dp = jddp.DataParallel(lambda p, s, b, r: jnp.sum(b["x"]), optax.sgd(0.1), mesh=jddp.data_mesh())
    with pytest.raises(TypeError, match=r"must return `\(loss, \(new_model_state, metrics\)\)`"):
        dp.step(dp.init(model.params), models.batch(64))


def test_non_array_leaf_in_params(setup):
    _, dp = setup
    with pytest.raises(TypeError, match=r"params\['act'\] is str \('relu'\).*jnp.asarray"):
        dp.init({"w": np.ones(3, np.float32), "act": "relu"})
    with pytest.raises(TypeError, match=r"model_state\['n'\] is float"):
        dp.init({"w": np.ones(3, np.float32)}, {"n": 1.0})


def test_state_from_another_mesh(setup):
    model, dp = setup
    other = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(jax.devices()[:4]))
    state = other.init(model.params)
    with pytest.raises(ValueError, match=r"`state` lives on another mesh.*restore the checkpoint onto this mesh"):
        dp.step(state, models.batch(64))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


def test_not_a_train_state(setup):
    model, dp = setup
    with pytest.raises(TypeError, match=r"`state` must be a jddp.TrainState from `init`, got dict"):
        dp.step({"params": model.params}, models.batch(64))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulate_steps": 0}, r"accumulate_steps=0"),
        ({"reduce_dtype": jnp.int8}, r"reduce_dtype="),
        ({"clip_grad_norm": -1.0}, r"clip_grad_norm=-1.0"),
        ({"nonfinite": "warn"}, r"nonfinite=.warn."),
        ({"max_inflight": 0}, r"max_inflight=0"),
    ],
    ids=["accumulate", "reduce_dtype", "clip", "nonfinite", "inflight"],
)
def test_bad_options(setup, kwargs, match):
    model, _ = setup
    with pytest.raises(ValueError, match=match):
        jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), **kwargs)


def test_mesh_without_data_axis(setup):
    model, _ = setup
    mesh = jax.make_mesh((8,), ("batch",))
    with pytest.raises(ValueError, match=r"axis named 'data'.*jddp.data_mesh\(\)"):
        jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=mesh)


def test_bad_rng(setup):
    model, dp = setup
    with pytest.raises(TypeError, match=r"`rng` must be a JAX PRNG key or an int seed, got str"):
        dp.init(model.params, rng="seed")


def test_model_state_that_differs_across_devices_and_cannot_be_averaged_is_named_by_path():
    def loss_fn(params, model_state, batch, rng):
        seen = {"counts": {"rows": (batch["x"][0] > 0).astype(jnp.int32)}, "mean": jnp.mean(batch["x"])}
        return jnp.mean(batch["x"] * params["w"]), (seen, {})

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
    state = dp.init({"w": np.float32(1)}, {"counts": {"rows": np.int32(0)}, "mean": np.float32(0)})
    with pytest.raises(ValueError, match=r"Model state leaf model_state\['counts'\]\['rows'\] \(dtype=int32\) differs"):
        dp.step(state, {"x": np.arange(16, dtype=np.float32) - 8})
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))


GLOO_LOST = (
    "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
    "[10.231.0.3]:47307"
)


@pytest.mark.parametrize(
    "error, says, never",
    [
        # what gloo raised in a save's all-gather when a host of tests/test_slurm_hosts.py was lost mid-save
        (ValueError(GLOO_LOST), "a peer process is lost or cut off", "writable"),
        (RuntimeError("Read error [10.0.0.2]:690: Connection reset by peer"), "peer process is lost", "writable"),
        (OSError(28, "No space left on device"), "The disk is full", "peer"),
        (PermissionError(13, "Permission denied"), "writable and has space", "peer"),
    ],
)
def test_a_failed_write_names_its_cause_and_the_fix_for_it(tmp_path, error, says, never):
    """A checkpoint write that failed says what to fix: a broken exchange between processes is not the disk's
    fault (the message once sent the user to check the directory), a full disk is, and anything else may be."""
    from jddp.checkpoint import storage

    text = storage.write_failure(tmp_path, [8], [4, 8], error)
    assert says in text and never not in text, text
    assert "step 8" in text and "step 4, is intact" in text, text
