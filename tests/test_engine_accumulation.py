"""Model state under gradient accumulation: one rule on every device layout (docs/guides/engine.md, "Model state
under accumulation").

Micro-batch ``i`` of a step holds the global rows ``j`` with ``j % accumulate_steps == i`` on every layout; the
model state flows through the micro-batches in order; what still differs across devices after the last one is
averaged. So a model with synchronised BatchNorm trains the same on 1 device and on N, and a running mean the model
keeps per device (no axis name) ends as one device's, both checked here against 1 device and NumPy.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jddp
from jddp.engine import step as step_lib
from jddp.runtime import dispatch
from tests import models

LAYOUTS = (1, 2, 4, 8)  # devices; each against 1
MOMENTUM = 0.9


@pytest.fixture(scope="module")
def devices():
    if jax.device_count() < max(LAYOUTS):
        pytest.skip(f"needs {max(LAYOUTS)} devices")
    return jax.devices()


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", LAYOUTS)
def test_micro_batch_i_is_the_same_global_rows_on_every_layout(n, k):
    """The rule itself, generated over layouts: device ``d`` splits its slice with ``micro_batches``; the union
    over devices of micro-batch ``i`` is the rows ``j % k == i`` of the global batch, as on one device."""
    rows = n * k * 3
    index = np.arange(rows)
    per_device = np.split(index, n)
    for i in range(k):
        union = np.sort(np.concatenate([np.asarray(step_lib.micro_batches(jnp.asarray(s), k))[i] for s in per_device]))
        np.testing.assert_array_equal(union, index[index % k == i])


class LinenNet(nn.Module):
    """Dense (no bias: BatchNorm removes it) -> synchronised BatchNorm, twice, then a head."""

    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.Dense(models.HIDDEN, use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=MOMENTUM, axis_name=self.axis_name)(x))
        return nn.Dense(models.OUT)(x)


class NNXNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(models.IN, models.HIDDEN, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(models.HIDDEN, momentum=MOMENTUM, axis_name=jddp.DATA_AXIS, rngs=rngs)
        self.l2 = nnx.Linear(models.HIDDEN, models.OUT, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def _model(kind: str):
    fn = lambda run, batch, rng: models.classification(run(batch["x"]), batch)
    if kind == "linen":
        variables = LinenNet().init(jax.random.key(2), np.zeros((1, models.IN), np.float32))
        params, model_state = jddp.models.linen_split(variables)
        return jddp.models.linen_loss(LinenNet(axis_name=jddp.DATA_AXIS), fn), params, model_state
    graphdef, params, model_state = jddp.models.nnx_split(NNXNet(nnx.Rngs(3)))
    return jddp.models.nnx_loss(graphdef, lambda model, batch, rng: fn(model, batch, rng)), params, model_state


def _train(loss_fn, params, model_state, mesh, k, batches, optimizer):
    dp = jddp.DataParallel(loss_fn, optimizer, mesh=mesh, accumulate_steps=k)
    state = dp.init(params, model_state, rng=0)
    losses = []
    for b in batches:
        state, metrics = dp.step(state, b)
        losses.append(metrics["loss"])
    dispatch.DISPATCHER.drain()
    return jddp.models.to_host(state.params), jddp.models.to_host(state.model_state), np.asarray(losses)


@pytest.mark.slow  # seconds of compiling and training: the full tier
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_synchronised_batchnorm_under_accumulation_trains_alike_on_1_2_4_and_8_devices(devices, kind, k):
    """BatchNorm(axis_name="data"), adamw with weight decay, ``accumulate_steps=k``: 4 steps on every layout equal
    1 device's (params, batch statistics, losses) to float32 round-off. Before the rule, micro-batch ``i`` was
    another set of examples on each layout, and the losses split from the first step (4e-2 here)."""
    loss_fn, params, model_state = _model(kind)
    batches = [models.batch(8 * 4, seed) for seed in range(4)]
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    ref = _train(loss_fn, params, model_state, jddp.data_mesh(devices[:1]), k, batches, optimizer)
    assert np.all(np.isfinite(ref[2])) and ref[2][-1] != ref[2][0]
    for n in LAYOUTS[1:]:
        got = _train(loss_fn, params, model_state, jddp.data_mesh(devices[:n]), k, batches, optimizer)
        assert models.max_diff(got[0], ref[0]) < 1e-6, (n, "params")
        assert models.max_diff(got[1], ref[1]) < 1e-6, (n, "model state")
        np.testing.assert_allclose(got[2], ref[2], atol=1e-6, err_msg=f"losses on {n} devices")


def test_a_running_mean_kept_per_device_ends_as_one_devices_under_accumulation(devices):
    """Model state without an axis name: each device chains it through its micro-batches, then the devices'
    values are averaged. For a running mean (linear in the batch means) that is one device's chain over the
    global micro-batches exactly, against NumPy: ``m <- 0.9 m + 0.1 mean(rows j % k == i)`` for i = 0..k-1."""
    k, rows = 4, 64

    def loss_fn(params, model_state, batch, rng):
        m = MOMENTUM * model_state["m"] + (1 - MOMENTUM) * jnp.mean(batch["x"], axis=0)
        return jnp.mean((batch["x"] @ params["w"]) ** 2), ({"m": m}, {})

    x = np.random.default_rng(0).normal(size=(rows, 3)).astype(np.float32) ** 3
    expected = np.zeros(3)
    for i in range(k):
        expected = MOMENTUM * expected + (1 - MOMENTUM) * x[np.arange(rows) % k == i].astype(np.float64).mean(0)
    for n in LAYOUTS:
        dp = jddp.DataParallel(loss_fn, optax.sgd(0.0), mesh=jddp.data_mesh(devices[:n]), accumulate_steps=k)
        state, _ = dp.step(dp.init({"w": np.ones(3, np.float32)}, {"m": np.zeros(3, np.float32)}), {"x": x})
        np.testing.assert_allclose(np.asarray(state.model_state["m"]), expected, atol=1e-6, err_msg=f"{n} devices")
        dispatch.DISPATCHER.drain()
