"""The same global batches on any device count: ``DataLoader(..., max_per_device_batch_size=L)``.

On ``D`` devices the loader pads each global batch of ``B`` examples to ``D * k * m`` masked rows and asks for
``k`` accumulation steps; training with ``DataParallel(accumulate_steps=loader.accumulate_steps)`` must then be
the run of one device without padding or accumulation, to float round-off: the same losses and parameters, also
with dropout (per-example draws by place in the global batch), and across a checkpoint taken on 4 devices and
restored on 3 (the membership change of an elastic run).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jddp
from jddp.data import loader as loader_lib

IN, HIDDEN, OUT, SIZE, SEED, LR, KEEP = 5, 16, 3, 40, 3, 0.5, 0.7
_r = np.random.default_rng(0)
X = _r.normal(size=(SIZE, IN)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32) + (X[:, 1] > 0.5).astype(np.int32)
DATA = {"x": X, "y": Y}
PARAMS = {
    "w1": (_r.normal(size=(IN, HIDDEN)) * 0.5).astype(np.float32),
    "b1": np.zeros(HIDDEN, np.float32),
    "w2": (_r.normal(size=(HIDDEN, OUT)) * 0.5).astype(np.float32),
    "b2": np.zeros(OUT, np.float32),
}


def per_example(params, x, y, keep=None):
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
    if keep is not None:
        h = jnp.where(keep, h / KEEP, 0.0)
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"] + params["b2"][None], y)


def mlp_loss(params, model_state, batch, rng):
    return jddp.masked_mean(per_example(params, batch["x"], batch["y"]), batch["mask"]), (model_state, {})


def dropout_loss(params, model_state, batch, rng):
    keep = jax.random.bernoulli(rng, KEEP, (batch["x"].shape[0], HIDDEN))  # one mask row per example
    return jddp.masked_mean(per_example(params, batch["x"], batch["y"], keep), batch["mask"]), (model_state, {})


LOSSES = {"mlp": mlp_loss, "dropout": dropout_loss}


def setup(devices: int, batch: int, limit: int | None, loss: str, drop_last: bool = False):
    mesh = jddp.data_mesh(jax.devices()[:devices])
    loader = jddp.data.DataLoader(
        DATA, global_batch_size=batch, max_per_device_batch_size=limit, mesh=mesh, seed=SEED, drop_last=drop_last
    )
    dp = jddp.DataParallel(LOSSES[loss], optax.sgd(LR), mesh=mesh, accumulate_steps=loader.accumulate_steps)
    return loader, dp, dp.init(PARAMS, rng=0)


def train(loader, dp, state, steps: int):
    losses = []
    while len(losses) < steps:
        for batch in loader:
            state, metrics = dp.step(state, batch)
            losses.append(float(metrics["loss"]))
            if len(losses) == steps:
                break
    return state, np.array(losses)


def host(state) -> dict:
    return jax.tree.map(np.asarray, state.params)


def numpy_loss_and_grads(x, y, params):
    """The MLP's mean cross-entropy over ``x`` and its gradient, by hand in float64."""
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    pre = x @ w["w1"] + w["b1"]
    h = np.maximum(pre, 0)
    z = h @ w["w2"] + w["b2"]
    z -= z.max(1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(y)), y]))
    dz = (p - np.eye(OUT)[y]) / len(y)
    dpre = (dz @ w["w2"].T) * (pre > 0)
    return loss, {"w1": x.T @ dpre, "b1": dpre.sum(0), "w2": h.T @ dz, "b2": dz.sum(0)}


@functools.cache
def one_device(batch: int, loss: str, drop_last: bool, steps: int):
    """The reference run: one device, no padding, no accumulation."""
    loader, dp, state = setup(1, batch, None, loss, drop_last)
    assert (loader.accumulate_steps, loader.padded_batch_size) == (1, batch)
    state, losses = train(loader, dp, state, steps)
    return host(state), losses


def assert_same_run(a, b):
    (pa, la), (pb, lb) = a, b
    np.testing.assert_allclose(la, lb, rtol=1e-5, atol=1e-6)
    for k in pa:
        np.testing.assert_allclose(pa[k], pb[k], rtol=1e-5, atol=1e-6, err_msg=k)


def numpy_run(batch: int, drop_last: bool, steps: int):
    """SGD on the MLP in NumPy over the global batches as the sampler's docstring defines them (one global order
    per epoch from ``default_rng([seed, epoch])``, batch ``b`` its entries ``[b*B, (b+1)*B)``)."""
    per_epoch = SIZE // batch if drop_last else -(-SIZE // batch)
    params, losses = dict(PARAMS), []
    for position in range(steps):
        epoch, b = divmod(position, per_epoch)
        examples = np.random.default_rng([SEED, epoch]).permutation(SIZE)[b * batch : (b + 1) * batch]
        loss, grads = numpy_loss_and_grads(X[examples], Y[examples], params)
        params = {k: v - LR * grads[k] for k, v in params.items()}
        losses.append(loss)
    return params, np.array(losses)


STEPS = 3


@settings(max_examples=2, deadline=None)
@given(st.integers(1, 4), st.integers(5, 20), st.integers(1, 6), st.booleans())
@example(devices=3, batch=16, limit=2, drop_last=False)  # 3 devices x 3 micro-batches x 2 rows: 2 padding rows
@example(devices=4, batch=14, limit=5, drop_last=True)
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_mlp_trains_as_plain_sgd_on_any_device_count(devices, batch, limit, drop_last):
    """Against NumPy: each step's loss and the parameters after STEPS steps (into the next epoch for the larger
    batches); compiling the step is most of the time, so one program per example."""
    loader, dp, state = setup(devices, batch, limit, "mlp", drop_last)
    k, padded = loader.accumulate_steps, loader.padded_batch_size
    assert k == -(-batch // (devices * limit)) and padded % (devices * k) == 0
    assert batch <= padded and padded // (devices * k) <= limit  # the limit holds per micro-batch
    assert loader.global_batch_size == batch and loader.per_device_batch_size == padded // devices
    state, losses = train(loader, dp, state, STEPS)
    assert_same_run((host(state), losses), numpy_run(batch, drop_last, STEPS))


@settings(max_examples=1, deadline=None)
@given(st.integers(1, 4), st.sampled_from([12, 16]), st.integers(1, 6))
@example(devices=3, batch=16, limit=2)
@example(devices=1, batch=12, limit=5)  # one device, 3 micro-batches of 4 rows: the micro-batches' own draws
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_dropout_trains_as_one_device_on_any_device_count(devices, batch, limit):
    state, losses = train(*setup(devices, batch, limit, "dropout"), STEPS)
    assert_same_run((host(state), losses), one_device(batch, "dropout", False, STEPS))


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_a_checkpoint_of_4_devices_resumes_on_3_as_the_same_run(tmp_path):
    """The membership change: saved on 4 devices (2 micro-batches of 2 rows, no padding), continued on 3 (2 of 3
    rows, 2 padding rows); the losses are the uninterrupted 4-device run's."""
    batch, limit = 16, 3
    loader, dp, state = setup(4, batch, limit, "dropout")
    assert (loader.accumulate_steps, loader.padded_batch_size) == (2, 16)
    state, _ = train(loader, dp, state, 2)
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, loader, wait=True)
    state, after = train(loader, dp, state, 3)
    loader3, dp3, fresh = setup(3, batch, limit, "dropout")
    assert (loader3.accumulate_steps, loader3.padded_batch_size) == (2, 18)
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
        resumed, loader3 = ckpt.restore_or_init(fresh, loader3)
    assert int(resumed.step) == 2 and loader3.get_state()["position"] == 2
    resumed, continued = train(loader3, dp3, resumed, 3)
    np.testing.assert_allclose(continued, after, rtol=1e-5, atol=1e-6)
    assert_same_run((host(resumed), continued), (host(state), after))


def test_fit_refuses_a_data_parallel_with_other_accumulate_steps_before_any_step(tmp_path):
    loader, _, _ = setup(3, 16, 2, "mlp")
    assert loader.accumulate_steps == 3
    dp = jddp.DataParallel(mlp_loss, optax.sgd(LR), mesh=loader.mesh)  # accumulate_steps=1
    state = dp.init(PARAMS, rng=0)
    match = r"accumulate_steps=3 micro-batches .* accumulate_steps=1\. .*accumulate_steps=loader\.accumulate_steps"
    with pytest.raises(ValueError, match=match):
        jddp.fit(dp, state, loader, steps=2, log_dir=tmp_path / "logs", progress=False)
    assert int(state.step) == 0 and loader.get_state()["position"] == 0
    # Without max_per_device_batch_size the loader asks for nothing: any accumulate_steps of DataParallel goes.
    plain = jddp.data.DataLoader(DATA, global_batch_size=12, mesh=loader.mesh, seed=SEED)
    loader_lib.check_accumulate_steps(plain, 2)
