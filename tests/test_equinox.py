"""The Equinox adapter: training mode for ``eqx_loss`` and inference mode for ``eqx_eval`` whatever mode the model
was split in, ``eqx.nn.State`` as model state (averaged over devices after each step), Dropout keys from jddp's rng,
and the way back (``eqx_module``) predicting what ``eval_step`` measured. The 8-devices-against-one equivalence of
an Equinox model is ``tests/test_engine.py::test_equivalence_to_one_device_and_pmap[equinox]``.

``eqx.nn.BatchNorm`` cannot run inside jddp's step on JAX 0.10: its ``lax.pmean`` over the vmapped batch axis,
inside ``shard_map`` with ``check_vma=True``, fails an assertion in JAX's ``pvary`` (also with ``axis_name=("batch",
"data")``). The stateful layer here keeps a running mean of its input in an ``eqx.nn.State`` the same way.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp import models
from tests import models as test_models
from tests.test_models import numpy_metrics

N = 16
DEVICES = 4


class RunningMean(eqx.Module):
    """Centres its input with the batch mean and keeps a running mean (momentum 0.5) in an ``eqx.nn.State``;
    in inference mode it centres with the running mean."""

    index: eqx.nn.StateIndex
    inference: bool

    def __init__(self, size: int):
        self.index = eqx.nn.StateIndex(jnp.zeros(size))
        self.inference = False

    def __call__(self, x, state):
        if self.inference:
            return x - state.get(self.index)[None], state
        mean = jnp.mean(x, axis=0)
        return x - mean[None], state.set(self.index, 0.5 * state.get(self.index) + 0.5 * mean)


class Net(eqx.Module):
    l1: eqx.nn.Linear
    centre: RunningMean
    drop: eqx.nn.Dropout
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(test_models.IN, test_models.HIDDEN, key=k1)
        self.centre = RunningMean(test_models.HIDDEN)
        self.drop = eqx.nn.Dropout(0.5)
        self.l2 = eqx.nn.Linear(test_models.HIDDEN, test_models.OUT, key=k2)

    def __call__(self, x, state, key=None):
        h, state = self.centre(jax.vmap(self.l1)(x), state)
        kept = (self.drop(jnp.ones((x.shape[0], 64)), key=key) > 0).astype(jnp.float32)
        return jax.vmap(self.l2)(jax.nn.relu(h)), state, kept


def loss(model, state, batch, key):
    logits, state, kept = model(batch["x"], state, key)
    value, metrics = test_models.classification(logits, batch)
    return (
        value,
        state,
        {**metrics, "kept": jnp.mean(kept), "first_mask": jnp.mean(kept[:, :8] @ (2.0 ** jnp.arange(8)))},
    )


def evaluate(model, state, batch):
    logits, _, kept = model(batch["x"], state)
    value, metrics = test_models.classification(logits, batch)
    return {"loss": value, **metrics, "kept": jnp.mean(kept)}


def setup(inference: bool):
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    model = eqx.nn.inference_mode(model, inference)  # the mode the model happens to be in when it is split
    static, params, model_state = models.eqx_split(model, state)
    dp = jddp.DataParallel(
        models.eqx_loss(static, loss),
        optax.adam(0.05),
        mesh=jddp.data_mesh(jax.devices()[:DEVICES]),
        eval_fn=models.eqx_eval(static, evaluate),
    )
    return static, dp, dp.init(params, model_state)


def test_eqx_loss_trains_in_training_mode_even_if_split_in_inference_mode():
    _, dp, state = setup(inference=True)
    batch = test_models.batch(N, seed=0)
    w, b = np.asarray(state.params.l1.weight), np.asarray(state.params.l1.bias)
    state, metrics = dp.step(state, batch)
    assert 0.3 < metrics["kept"] < 0.7  # dropout is on (inference mode keeps everything)
    # Each device's batch mean (training mode), then jddp's mean over devices.
    (running,) = [np.asarray(x) for x in jax.tree.leaves(state.model_state)]
    pre = (batch["x"] @ w.T + b).reshape(DEVICES, N // DEVICES, -1)
    np.testing.assert_allclose(running, 0.5 * pre.mean(1).mean(0), atol=1e-6)
    jddp.engine.replicas.assert_identical(state.model_state)


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_dropout_draws_new_masks_every_step_and_the_same_on_a_rerun():
    runs = []
    for _ in range(2):
        _, dp, state = setup(inference=False)
        masks = []
        for i in range(3):
            state, metrics = dp.step(state, test_models.batch(N, seed=i))
            masks.append(metrics["first_mask"])
        runs.append(masks)
    assert len(set(runs[0])) == 3 and runs[0] == runs[1]


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_eqx_eval_is_in_inference_mode_and_the_exported_model_predicts_what_it_measured():
    static, dp, state = setup(inference=False)
    for i in range(4):
        state, _ = dp.step(state, test_models.batch(N, seed=i))
    batch = test_models.batch(N, seed=9)
    measured = dp.eval_step(state, batch)
    assert measured["kept"] == 1.0  # no dropout
    model, model_state = models.eqx_module(static, state)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))  # on the host
    logits, _, _ = model(batch["x"], model_state)
    value, accuracy = numpy_metrics(np.asarray(logits, np.float64), batch["y"])
    np.testing.assert_allclose(measured["loss"], value, rtol=2e-6)
    np.testing.assert_allclose(measured["accuracy"], accuracy, rtol=1e-6)
    # Running statistics, not the batch's: an example's output does not depend on the rest of the batch.
    half, _, _ = model(batch["x"][:8], model_state)
    np.testing.assert_allclose(np.asarray(half), np.asarray(logits)[:8], rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_a_checkpoint_holds_the_equinox_state(tmp_path):
    _, dp, state = setup(inference=False)
    state, _ = dp.step(state, test_models.batch(N, seed=0))
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, wait=True)
    with jddp.Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        restored = ckpt.restore_or_init(setup(inference=False)[2])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------- loss functions with and without `state`

STEPS, LR = 4, 0.1


def _stateless_loss(model, batch, key):
    return test_models.classification(model(batch["x"]), batch)[0]


def _stateless_loss_and_metrics(model, batch, key):
    return test_models.classification(model(batch["x"]), batch)


def _stateful_loss(model, state, batch, key):
    loss, metrics = test_models.classification(model(batch["x"]), batch)
    return loss, state, metrics


def _plain_jit_reference(batches):
    """The same model and SGD under ``eqx.filter_jit`` on whole global batches, without jddp."""
    model = test_models.EqxMLP(jax.random.key(4))
    optimizer = optax.sgd(LR)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(lambda m: _stateless_loss(m, batch, None))(model)
        updates, opt_state = optimizer.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for batch in batches:
        model, opt_state, loss = step(model, opt_state, batch)
        losses.append(float(loss))
    return eqx.filter(model, eqx.is_inexact_array), losses


def _train_with_jddp(fn):
    static, params, model_state = models.eqx_split(test_models.EqxMLP(jax.random.key(4)))
    dp = jddp.DataParallel(models.eqx_loss(static, fn), optax.sgd(LR), mesh=jddp.data_mesh())
    state = dp.init(params, model_state)
    losses = []
    for i in range(STEPS):
        state, metrics = dp.step(state, test_models.batch(32, seed=i))
        losses.append(float(metrics["loss"]))
    return models.to_host(state.params), losses


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_a_loss_without_state_trains_as_one_with_state_and_as_plain_jit_on_8_devices():
    """``fn(model, batch, key) -> loss``, ``-> (loss, metrics)`` and ``fn(model, state, batch, key) -> (loss, state,
    metrics)`` give the same steps on 8 devices as a plain ``eqx.filter_jit`` loop on one."""
    assert jax.device_count() == 8
    reference, reference_losses = _plain_jit_reference([test_models.batch(32, seed=i) for i in range(STEPS)])
    runs = {fn.__name__: _train_with_jddp(fn) for fn in (_stateless_loss, _stateless_loss_and_metrics, _stateful_loss)}
    for name, (params, losses) in runs.items():
        np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, err_msg=name)
        for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6, err_msg=name)
    for name, (params, _) in runs.items():  # the three forms: the same computation, bit for bit
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(runs["_stateful_loss"][0]), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
    initial = eqx.filter(test_models.EqxMLP(jax.random.key(4)), eqx.is_inexact_array)
    assert not np.allclose(np.asarray(reference.l1.weight), np.asarray(initial.l1.weight))  # it trained


def _two(model, batch):
    return 0.0


def _five(model, state, batch, key, extra):
    return 0.0


def _star(*args):
    return 0.0


@pytest.mark.parametrize("fn", [_two, _five, _star, len], ids=["two", "five", "star-args", "builtin"])
def test_a_loss_of_another_shape_is_a_type_error_naming_both_forms(fn):
    static, _, _ = models.eqx_split(test_models.EqxMLP(jax.random.key(4)))
    with pytest.raises(TypeError, match=r"fn\(model, batch, key\).*fn\(model, state, batch, key\)"):
        models.eqx_loss(static, fn)


def test_a_loss_without_state_for_a_model_with_state_is_a_type_error():
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    static, params, model_state = models.eqx_split(model, state)
    loss_fn = models.eqx_loss(static, lambda model, batch, key: 0.0)
    with pytest.raises(TypeError, match=r"the model has an eqx\.nn\.State .* fn\(model, state, batch, key\)"):
        loss_fn(params, model_state, test_models.batch(8), jax.random.key(0))


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (lambda model, batch, key: (1.0, {}, {}), r"must return loss or \(loss, metrics\), got a tuple of 3"),
        (lambda model, state, batch, key: 1.0, r"must return \(loss, state\) or \(loss, state, metrics\), got float"),
    ],
    ids=["stateless", "stateful"],
)
def test_a_wrong_return_names_the_form_expected(fn, expected):
    static, params, model_state = models.eqx_split(test_models.EqxMLP(jax.random.key(4)))
    with pytest.raises(TypeError, match=expected):
        models.eqx_loss(static, fn)(params, model_state, test_models.batch(8), jax.random.key(0))
