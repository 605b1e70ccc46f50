"""What PyTorch users write between ``backward()`` and ``optimizer.step()``, and AMP's autocast, in jddp.

``grad_hook`` sees the averaged gradient (checked against one device's gradient of the whole batch), its result
feeds the optimizer and its metrics join the step's; ``local_metrics`` reports each device's own loss and gradient
norm through the one all-reduce; ``compute_dtype`` runs the forward and backward pass in bfloat16 with float32
parameters, gradients and optimizer state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.engine import loss_scale
from tests import models

N = 8


def setup(**options):
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), **options)
    return model, dp, dp.init(model.params, rng=0)


def test_grad_hook_sees_the_averaged_gradient_and_its_result_feeds_the_update():
    b = models.batch(64)
    seen = {}

    def hook(grads, params):
        seen["tree"] = jax.tree.structure(grads)
        return jax.tree.map(lambda g: 2.0 * g, grads), {"hook_norm": optax.tree.norm(grads)}

    model, dp, state = setup(grad_hook=hook)
    new, metrics = dp.step(state, b)
    grads = jax.grad(lambda p: model.ref_loss_fn(p, {}, b, None)[0])(model.params)
    assert abs(metrics["hook_norm"] - float(optax.tree.norm(grads))) < 1e-5  # the mean over the global batch
    expected = jax.tree.map(lambda p, g: p - 0.1 * 2.0 * g, model.params, grads)  # doubled by the hook
    assert models.max_diff(jddp.models.to_host(new.params), expected) < 1e-6
    assert seen["tree"] == jax.tree.structure(model.params)


def test_grad_hook_must_return_the_gradients_tree():
    _, dp, state = setup(grad_hook=lambda g, p: jax.tree.leaves(g))
    with pytest.raises(TypeError, match=r"`grad_hook` must return the gradients as it got them"):
        dp.step(state, models.batch(64))
    with pytest.raises(TypeError, match=r"`grad_hook` must be a function .* got int"):
        setup(grad_hook=3)


def test_local_metrics_report_each_devices_own_loss_in_the_one_all_reduce():
    b = models.batch(64)
    model, dp, state = setup(local_metrics=True)
    report = dp.comm_report(state, b)
    _, metrics = dp.step(state, b)
    rows = 64 // N
    for i in range(N):
        part = {k: v[i * rows : (i + 1) * rows] for k, v in b.items()}
        loss, _ = model.ref_loss_fn(model.params, {}, part, None)
        grads = jax.grad(lambda p, part=part: model.ref_loss_fn(p, {}, part, None)[0])(model.params)
        assert abs(metrics[f"local_loss/{i}"] - float(loss)) < 1e-5, i
        assert abs(metrics[f"local_grad_norm/{i}"] - float(optax.tree.norm(grads))) < 1e-5, i
    assert np.mean([metrics[f"local_loss/{i}"] for i in range(N)]) == pytest.approx(metrics["loss"], abs=1e-6)
    assert report.count("all-reduce") == 1


def test_compute_dtype_bfloat16_computes_in_bfloat16_and_keeps_float32_state():
    b = models.batch(64)
    _, dp32, state32 = setup()
    _, dp16, state16 = setup(compute_dtype=jnp.bfloat16)

    def hlo(dp, state):
        return dp._step.lower(*dp._args(state, jax.device_put(b, dp._batch))).as_text()

    assert "bf16" in hlo(dp16, state16) and "bf16" not in hlo(dp32, state32)
    for _ in range(5):
        state32, m32 = dp32.step(state32, b)
        state16, m16 = dp16.step(state16, b)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state16.params))
    floats = [x for x in jax.tree.leaves(state16.opt_state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    assert all(x.dtype == jnp.float32 for x in floats)
    assert abs(m16["loss"] - m32["loss"]) < 2e-2 * abs(m32["loss"])  # bfloat16's 8 bits of mantissa
    assert m16["loss"] != m32["loss"]


def test_compute_dtype_must_be_a_float_dtype():
    with pytest.raises(ValueError, match=r"`compute_dtype` must be a float dtype .* got compute_dtype=<class"):
        setup(compute_dtype=jnp.int8)
    with pytest.raises(ValueError, match=r"`compute_dtype` must be a float dtype .* got compute_dtype='x'"):
        setup(compute_dtype="x")  # NumPy's own TypeError before


def test_compute_dtype_float16_scales_the_loss_and_halves_the_scale_on_overflow():
    """float16's gradients of a small loss underflow without a scale. With the scale (in the optimizer state): a
    step whose scaled gradient overflows is skipped, params unchanged, and halves the scale (GradScaler's first
    steps do the same), and the first finite step equals float32's update to float16 rounding, its reported
    gradient norm the true (unscaled) one."""
    b = models.batch(64)
    _, dp32, state32 = setup()
    _, dp16, state16 = setup(compute_dtype=jnp.float16)
    initial = jddp.models.to_host(state16.params)
    assert float(loss_scale.scale_of(state16.opt_state)) == loss_scale.INITIAL_SCALE
    for skipped in range(12):
        state16, m16 = dp16.step(state16, b)
        assert m16["loss_scale"] == loss_scale.INITIAL_SCALE / 2**skipped
        if m16["nonfinite"] == 0:
            break
        assert models.max_diff(jddp.models.to_host(state16.params), initial) == 0.0
    assert m16["nonfinite"] == 0
    new32, m32 = dp32.step(state32, b)
    assert abs(m16["grad_norm"] - m32["grad_norm"]) < 1e-2 * m32["grad_norm"]
    assert models.max_diff(jddp.models.to_host(state16.params), jddp.models.to_host(new32.params)) < 1e-3
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state16.params))
    # A batch whose scaled float16 gradient overflows: skipped, the scale halved.
    before, scale = jddp.models.to_host(state16.params), float(loss_scale.scale_of(state16.opt_state))
    after, m = dp16.step(state16, {**b, "x": b["x"] * 3e3})
    assert m["nonfinite"] == 1 and float(loss_scale.scale_of(after.opt_state)) == scale / 2
    assert models.max_diff(jddp.models.to_host(after.params), before) == 0.0


def test_float16_compute_needs_the_nonfinite_guard():
    with pytest.raises(ValueError, match=r"`compute_dtype=float16` scales the loss .* not 'ignore'"):
        setup(compute_dtype=jnp.float16, nonfinite="ignore")


@pytest.mark.parametrize("name", list(models.FACTORIES))
def test_compute_dtype_on_every_kind_of_model(name):
    """The policy casts whatever float leaves the params and batch hold: a plain pytree, Flax Linen and NNX (with
    SyncBatchNorm) and Equinox train in bfloat16 with float32 params and model state, near float32's step."""
    model = models.FACTORIES[name]()
    b = models.batch(64)
    losses, states = {}, {}
    for dtype in (None, jnp.bfloat16):
        dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), compute_dtype=dtype)
        state, metrics = dp.step(dp.init(model.params, model.model_state, rng=0), b)
        losses[dtype], states[dtype] = metrics["loss"], state
    new = states[jnp.bfloat16]
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new.params))
    floats = [x for x in jax.tree.leaves(new.model_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(x.dtype == jnp.float32 for x in floats)
    assert abs(losses[jnp.bfloat16] - losses[None]) < 2e-2 * abs(losses[None])
    assert losses[jnp.bfloat16] != losses[None]  # the forward pass did run in bfloat16
    assert models.max_diff(jddp.models.to_host(new.params), jddp.models.to_host(states[None].params)) < 5e-2
