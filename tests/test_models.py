"""The Flax adapters' modes and randomness, and the way back from a TrainState to a model.

* ``nnx_loss`` trains in train mode and ``nnx_eval`` evaluates in eval mode, whatever mode the model was
  split in;
* a model holding ``nnx.Rngs`` trains: two Dropout layers draw different masks, every step new ones, a
  rerun the same ones, and the streams in the model state do not change;
* ``nnx_module`` / ``linen_variables`` give back a model that predicts what ``eval_step`` measured
  (BatchNorm's running statistics included), checked with NumPy;
* a model of another library, given to any adapter, is refused naming the parameter, the library given and the
  one expected; a state of another model is refused by ``nnx_module``/``eqx_module`` naming ``state``.
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
from jddp import models
from tests import models as test_models

N = 16


class Dropouts(nnx.Module):
    """Linear, BatchNorm and two Dropout layers that share one ``nnx.Rngs``, the usual NNX style."""

    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(test_models.IN, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.5, axis_name=jddp.DATA_AXIS, rngs=rngs)
        self.drop1 = nnx.Dropout(0.5, rngs=rngs)
        self.drop2 = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        ones = jnp.ones((x.shape[0], 64))
        return self.bn(self.linear(x)), self.drop1(ones), self.drop2(ones)


def masks_loss(model, batch, rng):
    h, m1, m2 = model(batch["x"])
    kept = (m1 > 0).astype(jnp.float32)
    return jnp.mean(h**2), {
        "kept": jnp.mean(kept),
        "same_layers": jnp.mean((m1 == m2).astype(jnp.float32)),
        "first_mask": jnp.mean(kept[:, :8] @ (2.0 ** jnp.arange(8))),
    }


def dropout_setup(mode: str):
    model = Dropouts(nnx.Rngs(0))
    getattr(model, mode)()  # the mode the model happens to be in when it is split
    graphdef, params, model_state = models.nnx_split(model)
    dp = jddp.DataParallel(models.nnx_loss(graphdef, masks_loss), optax.sgd(0.1), mesh=jddp.data_mesh())
    return graphdef, dp, dp.init(params, model_state)


def run(dp, state, steps: int = 3):
    out = []
    for i in range(steps):
        state, metrics = dp.step(state, test_models.batch(N, seed=i))
        out.append({k: float(v) for k, v in metrics.items()})
    return state, out


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_nnx_loss_trains_in_train_mode_even_if_split_in_eval_mode():
    _, dp, state = dropout_setup("eval")
    stats = models.to_host(state.model_state["bn"])
    state, metrics = run(dp, state, 1)
    assert 0.3 < metrics[0]["kept"] < 0.7  # dropout is on (eval mode would keep everything)
    moved = models.to_host(state.model_state["bn"])
    assert not np.allclose(moved["mean"], stats["mean"])  # BatchNorm updated its statistics (frozen in eval mode)


def test_nnx_eval_evaluates_in_eval_mode_even_if_split_in_train_mode():
    model = test_models.NNXMLP(jddp.DATA_AXIS, nnx.Rngs(3))
    model.train()
    graphdef, params, model_state = models.nnx_split(model)
    dp = jddp.DataParallel(
        models.nnx_loss(graphdef, lambda m, b, r: test_models.classification(m(b["x"]), b)),
        optax.sgd(0.1),
        mesh=jddp.data_mesh(),
        eval_fn=models.nnx_eval(graphdef, lambda m, b: eval_metrics(m(b["x"]), b)),
    )
    state = dp.init(params, model_state)
    batch = test_models.batch(N, seed=5)
    one = dp.eval_step(state, {k: v[:8] for k, v in batch.items()})["loss"]
    # In eval mode BatchNorm uses its running statistics, so an example's output does not depend on the rest of
    # the batch: the mean over the first half alone equals the mean over the full batch's first half.
    half = dp.eval_step(state, {**batch, "mask": (np.arange(N) < 8).astype(np.float32)})["loss"]
    np.testing.assert_allclose(one, half, rtol=1e-6)


def eval_metrics(logits, batch):
    loss, metrics = test_models.classification(logits, batch)
    return {"loss": loss, **metrics}


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_two_dropout_layers_draw_different_masks_new_every_step_and_the_same_on_a_rerun():
    _, dp, state = dropout_setup("train")
    start = models.to_host(state.model_state)
    state, first = run(dp, state)
    _, dp2, state2 = dropout_setup("train")
    _, again = run(dp2, state2)
    assert all(0.3 < m["same_layers"] < 0.7 for m in first)  # the layers' masks agree only by chance
    assert len({m["first_mask"] for m in first}) == len(first)  # a new mask every step
    assert first == again  # reproducible from the seed
    end = models.to_host(state.model_state)
    for path in (("drop1", "rngs", "key"), ("drop2", "rngs", "count")):
        before, after = start, end
        for k in path:
            before, after = before[k], after[k]
        assert np.array_equal(before, after)  # the streams in the state never change


def test_an_exported_nnx_model_predicts_what_eval_step_measured():
    model = test_models.nnx_model()
    graphdef, _, _ = models.nnx_split(test_models.NNXMLP(jddp.DATA_AXIS, nnx.Rngs(3)))
    dp = jddp.DataParallel(
        model.loss_fn,
        optax.adam(0.05),
        mesh=jddp.data_mesh(),
        eval_fn=models.nnx_eval(graphdef, lambda m, b: eval_metrics(m(b["x"]), b)),
    )
    state = dp.init(model.params, model.model_state)
    for i in range(4):
        state, _ = dp.step(state, test_models.batch(N, seed=i))
    batch = test_models.batch(N, seed=9)
    measured = dp.eval_step(state, batch)
    exported = models.nnx_module(graphdef, state)
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(nnx.state(exported)))  # on the host
    logits = np.asarray(exported(batch["x"]), np.float64)
    loss, accuracy = numpy_metrics(logits, batch["y"])
    np.testing.assert_allclose(measured["loss"], loss, rtol=2e-6)
    np.testing.assert_allclose(measured["accuracy"], accuracy, rtol=1e-6)
    assert not np.allclose(models.to_host(state.model_state["bn"]["mean"]), 0)  # it trained its statistics


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_an_exported_nnx_model_trains_again_eagerly_with_its_dropout_streams():
    """``nnx_module``'s model switched back to ``.train()`` and called eagerly: BatchNorm updates its statistics
    in place and Dropout draws from its stream, so the arrays must be the host's own (they were read-only views
    of the device buffers) and the stream's key typed again (it came back as raw uint32 data)."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(6, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.dense(x)))

    graphdef, params, model_state = models.nnx_split(Net(nnx.Rngs(0)))
    dp = jddp.DataParallel(
        models.nnx_loss(graphdef, lambda m, b, r: jnp.mean(m(b["x"]) ** 2)), optax.sgd(0.1), mesh=jddp.data_mesh()
    )
    state, _ = dp.step(dp.init(params, model_state), {"x": np.random.RandomState(0).randn(16, 6).astype(np.float32)})
    exported = models.nnx_module(graphdef, state)
    assert all(x.flags.writeable for x in jax.tree.leaves(models.to_host(state)))
    x = np.random.RandomState(1).randn(8, 6).astype(np.float32)
    before = np.array(exported.bn.mean.get_value())
    exported.train()
    first, second = np.asarray(exported(x)), np.asarray(exported(x))
    assert not np.allclose(first, second)  # a new dropout mask per call
    assert not np.allclose(np.asarray(exported.bn.mean.get_value()), before)  # statistics updated in place
    exported.eval()
    np.testing.assert_array_equal(np.asarray(exported(x)), np.asarray(exported(x)))


class LinenEval(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(test_models.HIDDEN)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name=jddp.DATA_AXIS)(x)
        return nn.Dense(test_models.OUT)(nn.relu(x))


def test_exported_linen_variables_predict_what_eval_step_measured():
    module = LinenEval()
    variables = module.init(jax.random.key(0), np.zeros((1, test_models.IN), np.float32), train=False)
    params, model_state = models.linen_split(variables)

    def eval_fn(params, model_state, batch):
        logits = module.apply({"params": params, **model_state}, batch["x"], train=False)
        return eval_metrics(logits, batch)

    loss_fn = models.linen_loss(module, lambda apply, b, r: test_models.classification(apply(b["x"], train=True), b))
    dp = jddp.DataParallel(loss_fn, optax.adam(0.05), mesh=jddp.data_mesh(), eval_fn=eval_fn)
    state = dp.init(params, model_state)
    for i in range(4):
        state, _ = dp.step(state, test_models.batch(N, seed=i))
    batch = test_models.batch(N, seed=9)
    measured = dp.eval_step(state, batch)
    exported = models.linen_variables(state)
    assert set(exported) == {"params", "batch_stats"}
    logits = np.asarray(LinenEval().apply(exported, batch["x"], train=False), np.float64)
    loss, accuracy = numpy_metrics(logits, batch["y"])
    np.testing.assert_allclose(measured["loss"], loss, rtol=2e-6)
    np.testing.assert_allclose(measured["accuracy"], accuracy, rtol=1e-6)


def numpy_metrics(logits: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = -log_probs[np.arange(len(labels)), labels].mean()
    return float(loss), float((logits.argmax(axis=1) == labels).mean())


def objects() -> dict[str, object]:
    """A model of each library, and what the adapters make of it (an NNX graphdef, an Equinox static part)."""
    nnx_model = test_models.NNXMLP(None, nnx.Rngs(0))
    eqx_model = test_models.EqxMLP(jax.random.key(0))
    return {
        "nnx": nnx_model,
        "graphdef": models.nnx_split(nnx_model)[0],
        "linen": test_models.LinenMLP(),
        "eqx": eqx_model,
        "static": models.eqx_split(eqx_model)[0],
    }


def fn3(model, batch, rng):
    return jnp.float32(0.0)


# (adapter, the parameter given a model of another library, the other arguments, the library expected, given)
OTHER_LIBRARY = [
    ("nnx_split", "model", {}, "Flax NNX", "linen", "Flax Linen"),
    ("nnx_loss", "graphdef", {"fn": fn3}, "Flax NNX", "static", "Equinox"),
    ("nnx_eval", "graphdef", {"fn": fn3}, "Flax NNX", "linen", "Flax Linen"),
    ("linen_loss", "module", {"fn": fn3}, "Flax Linen", "nnx", "Flax NNX"),
    ("linen_split", "variables", {}, "Flax Linen", "nnx", "Flax NNX"),
    ("eqx_split", "model", {}, "Equinox", "nnx", "Flax NNX"),
    ("eqx_loss", "static", {"fn": fn3}, "Equinox", "graphdef", "Flax NNX"),
    ("eqx_eval", "static", {"fn": fn3}, "Equinox", "linen", "Flax Linen"),
]


@pytest.mark.parametrize(
    ("adapter", "param", "others", "expected", "given", "given_name"), OTHER_LIBRARY, ids=[c[0] for c in OTHER_LIBRARY]
)
def test_a_model_of_another_library_is_refused_naming_the_parameter_and_both_libraries(
    adapter, param, others, expected, given, given_name
):
    with pytest.raises(TypeError) as error:
        getattr(models, adapter)(**{param: objects()[given]}, **others)
    message = str(error.value)
    assert f"`{param}`" in message and f"takes {expected} models" in message, message
    assert f"got a {given_name} object" in message or f"got an {given_name} object" in message, message
    assert f"{given_name} models go through jddp.models." in message, message


@pytest.mark.parametrize("adapter", ["nnx_loss", "nnx_eval", "linen_loss", "eqx_loss", "eqx_eval"])
def test_a_model_given_as_fn_is_refused_naming_fn(adapter):
    """A model is callable, so `callable(fn)` alone would take it: refused as the model it is."""
    first = {"nnx_loss": "graphdef", "nnx_eval": "graphdef", "linen_loss": "module"}.get(adapter, "static")
    things = objects()
    owner = {"graphdef": things["graphdef"], "module": things["linen"], "static": things["static"]}[first]
    with pytest.raises(TypeError, match=r"`fn` must be your function .*, got an? .* object \(\w+MLP\)"):
        getattr(models, adapter)(owner, things["linen"] if adapter != "linen_loss" else things["nnx"])


def test_a_state_of_another_model_or_a_host_copy_is_refused_naming_state():
    things = objects()
    plain = test_models.pytree()
    dp = jddp.DataParallel(plain.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
    state = dp.init(plain.params)  # the pytree model's state, not the NNX or Equinox model's
    with pytest.raises(ValueError, match=r"`nnx_module`'s `state` does not hold the model of `graphdef`"):
        models.nnx_module(things["graphdef"], state)
    with pytest.raises(ValueError, match=r"`eqx_module`'s `state` does not hold the model of `static`"):
        models.eqx_module(things["static"], state)
    with pytest.raises(TypeError, match=r"`linen_variables`'s `state` must hold jax.Arrays, .* \(a host copy\?\)"):
        models.linen_variables(jax.tree.map(np.asarray, state))
