"""float64 end to end: with ``jax_enable_x64`` and float64 parameters, gradients, their mean, the optimizer update
and the reported metrics keep float64, equal to a single-device float64 step to 1e-15 (a float32 cast anywhere on
the way is off by about 1e-8); float32 parameters under x64 still train in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp

IN, HIDDEN, OUT, N = 12, 16, 4, 24
MASK = (np.arange(N) % 5 != 3).astype(np.float64)  # uneven: 5 devices' slices hold different real counts


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def init(dtype) -> dict:
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(dtype),
        "b1": np.zeros(HIDDEN, dtype),
        "w2": (rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(dtype),
    }


def per_example(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y)


def loss_fn(params, model_state, batch, rng):
    losses = per_example(params, batch["x"], batch["y"])
    mean = jddp.masked_mean(losses, batch["mask"])
    return mean, (model_state, {"mean_x": jddp.masked_mean(batch["x"][:, 0], batch["mask"])})


def batch(seed: int, dtype=np.float64) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(N, IN)).astype(dtype),
        "y": rng.integers(0, OUT, size=N).astype(np.int32),
        "mask": MASK.astype(dtype),
    }


def reference(params, batches, optimizer):
    """One device, plain jit: the masked mean over the whole global batch, float64 throughout."""

    def objective(params, b):
        losses = per_example(params, b["x"], b["y"])
        return jnp.sum(losses * b["mask"]) / jnp.sum(b["mask"])

    @jax.jit
    def step(params, opt_state, b):
        loss, grads = jax.value_and_grad(objective)(params, b)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.tree.map(jnp.asarray, params)
    opt_state = optimizer.init(params)
    losses = []
    for b in batches:
        params, opt_state, loss = step(params, opt_state, b)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize(
    ("accumulate_steps", "shard_optimizer"), [(1, False), (3, False), (1, True), (2, True)], ids=str
)
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_float64_params_train_in_float64_like_one_device(accumulate_steps, shard_optimizer):
    """ZeRO-1 too: on 3 devices ``b1`` (16) and ``w2`` (16 x 4) are zero-padded to 18 rows before they are split, and
    the momentum's slices, the reduce-scatter and the all-gather all stay float64."""
    optimizer = optax.sgd(0.5, momentum=0.9)
    devices = jax.devices()[:3] if shard_optimizer else jax.devices()[:4]
    dp = jddp.DataParallel(
        loss_fn,
        optimizer,
        mesh=jddp.data_mesh(devices),
        accumulate_steps=accumulate_steps,
        shard_optimizer=shard_optimizer,
    )
    state = dp.init(init(np.float64), rng=0)
    if shard_optimizer:
        assert all(x.dtype == np.float64 for x in jax.tree.leaves(state.opt_state))
        layouts = [lay for lay in state.opt_layout if lay is not None and lay.axis is not None]
        assert any(lay.stored != lay.shape[lay.axis] for lay in layouts), layouts  # padding under x64 as well
    batches = [batch(i) for i in range(5)]
    losses, mean_x = [], []
    for b in batches:
        state, metrics = dp.step(state, b)
        losses.append(metrics["loss"])
        mean_x.append(metrics["mean_x"])
    assert all(x.dtype == np.float64 for x in jax.tree.leaves(state.params))
    ref_params, ref_losses = reference(init(np.float64), batches, optimizer)
    for name in ref_params:
        np.testing.assert_allclose(np.asarray(state.params[name]), np.asarray(ref_params[name]), rtol=0, atol=1e-15)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-15)
    expected_x = [np.sum(b["x"][:, 0] * b["mask"]) / np.sum(b["mask"]) for b in batches]  # NumPy, float64
    np.testing.assert_allclose(mean_x, expected_x, rtol=0, atol=1e-15)


def test_float64_eval_metrics_are_float64():
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(jax.devices()[:4]))
    state = dp.init(init(np.float64), rng=0)
    b = batch(7)
    metrics = dp.eval_step(state, b)
    expected = np.sum(b["x"][:, 0] * b["mask"]) / np.sum(b["mask"])
    np.testing.assert_allclose(metrics["mean_x"], expected, rtol=0, atol=1e-15)


def test_float32_params_under_x64_still_train_in_float32():
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.5), mesh=jddp.data_mesh(jax.devices()[:4]))
    state = dp.init(init(np.float32), rng=0)
    state, _ = dp.step(state, batch(0, np.float32))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
    ref_params, _ = reference(init(np.float32), [batch(0, np.float32)], optax.sgd(0.5))
    for name in ref_params:
        np.testing.assert_allclose(np.asarray(state.params[name]), np.asarray(ref_params[name]), atol=1e-6)


def test_a_float64_state_is_saved_and_restored_bitwise(tmp_path):
    dp = jddp.DataParallel(loss_fn, optax.adam(0.1), mesh=jddp.data_mesh(jax.devices()[:4]))
    state, _ = dp.step(dp.init(init(np.float64), rng=0), batch(0))
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, wait=True)
    with jddp.Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        restored = ckpt.restore_or_init(dp.init(init(np.float64), rng=1))
    for a, b in zip(
        jax.tree.leaves(state.opt_state) + jax.tree.leaves(state.params),
        jax.tree.leaves(restored.opt_state) + jax.tree.leaves(restored.params),
        strict=True,
    ):
        assert np.asarray(b).dtype == np.asarray(a).dtype
        assert np.array_equal(np.asarray(a), np.asarray(b))
