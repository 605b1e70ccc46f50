"""A script's own train step under ``jddp.data_parallel`` with ``jddp.average_gradients``: against plain ``jax.jit``
on one device, against ``jddp.DataParallel`` on the same model, its one all-reduce, its identical replicas, and the
refusals that keep an un-averaged output from coming back as device 0's."""

from __future__ import annotations

from collections.abc import Callable

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import jddp
from jddp.runtime import dispatch

N = 8
ROWS = 32


def _mesh(n: int):
    return jddp.data_mesh(jax.devices()[:n])


def _batches(steps: int, *, masked: bool = False, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        b = {
            "x": rng.normal(size=(ROWS, 6)).astype(np.float32),
            "y": rng.integers(0, 3, size=(ROWS,)).astype(np.int32),
        }
        if masked:  # uneven real examples per device: the average of averages would be wrong
            b["mask"] = (rng.random(ROWS) < 0.6).astype(np.float32)
            b["mask"][:4] = 1
        out.append(b)
    return out


class MLP(nn.Module):
    dropout: float = 0.0

    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.relu(nn.Dense(16)(x))
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        return nn.Dense(3)(x)


def _xent(logits, batch):
    return jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))


def _flax_state(tx, dropout: float = 0.0):
    model = MLP(dropout)
    params = model.init(jax.random.key(0), jnp.zeros((1, 6)), train=False)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def flax_train_step(state, batch, key):
    """Flax's way, as in its examples: value_and_grad, apply_gradients; plus the one line for the metric."""
    key = jax.random.fold_in(key, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"], train=True, rngs={"dropout": key})
        return _xent(logits, batch)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": jddp.global_mean(loss)}


def _tx():
    return optax.chain(jddp.average_gradients(), optax.add_decayed_weights(1e-2), optax.adam(1e-2))


def _run(step, state, batches, key):
    losses = []
    for b in batches:
        state, metrics = step(state, b, key)
        losses.append(float(metrics["loss"]))
    dispatch.DISPATCHER.drain()
    return state, np.array(losses)


def _max_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in pairs)


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True], ids=["full", "uneven-mask"])
def test_flax_step_equals_one_device_jit_on_every_layout(masked):
    """The same step function under plain jax.jit on one device (global_mean and average_gradients are the
    identity there) and under data_parallel on 1, 2 and 8 devices, with dropout on (rng="example")."""
    batches, key = _batches(3, masked=masked), jax.random.key(3)
    reference, ref_losses = _run(jax.jit(flax_train_step), _flax_state(_tx(), 0.3), batches, key)
    for n in (1, 2, N):
        step = jddp.data_parallel(flax_train_step, batch_argnums=1, mesh=_mesh(n))
        state, losses = _run(step, _flax_state(_tx(), 0.3), batches, key)
        assert _max_diff(state.params, reference.params) < 2e-6, n
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-6, atol=1e-7)
        step.check_replicas(state)


@pytest.mark.slow
def test_equals_dataparallel_on_the_same_model():
    """jddp's own engine and the user's own step, same model, optimizer and batches (uneven masks)."""
    batches, key = _batches(4, masked=True), jax.random.key(0)
    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 6)), train=False)["params"]

    def loss_fn(p, model_state, batch, rng):
        return _xent(model.apply({"params": p}, batch["x"], train=False), batch), (model_state, {})

    dp = jddp.DataParallel(loss_fn, optax.chain(optax.add_decayed_weights(1e-2), optax.adam(1e-2)), mesh=_mesh(N))
    dp_state = dp.init(params)
    for b in batches:
        dp_state, _ = dp.step(dp_state, b)

    def own(state, batch, key):
        del key
        logits = lambda p: state.apply_fn({"params": p}, batch["x"], train=False)
        loss, grads = jax.value_and_grad(lambda p: _xent(logits(p), batch))(state.params)
        return state.apply_gradients(grads=grads), {"loss": jddp.global_mean(loss)}

    state, _ = _run(jddp.data_parallel(own, batch_argnums=1, mesh=_mesh(N)), _flax_state(_tx()), batches, key)
    assert _max_diff(state.params, dp_state.params) < 2e-6


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.nn.GRUCell
    linear: eqx.nn.Linear
    activation: Callable  # a function: a static leaf, as eqx.filter_jit treats it

    def __init__(self, *, key):
        ckey, lkey = jax.random.split(key)
        self.hidden_size = 8
        self.cell = eqx.nn.GRUCell(2, 8, key=ckey)
        self.linear = eqx.nn.Linear(8, 1, key=lkey)
        self.activation = jax.nn.sigmoid

    def __call__(self, xs):
        out, _ = jax.lax.scan(lambda h, x: (self.cell(x, h), None), jnp.zeros((self.hidden_size,)), xs)
        return self.activation(self.linear(out))


@pytest.mark.slow
def test_equinox_make_step_with_static_leaves_equals_one_device():
    """Equinox's train_rnn shape: make_step(model, x, y, opt_state), the model holding a Python int and a
    function (static leaves), two batch arguments."""
    optim = optax.chain(jddp.average_gradients(), optax.adam(3e-3))

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        pred = jax.vmap(model)(x)
        return -jnp.mean(y * jnp.log(pred) + (1 - y) * jnp.log(1 - pred))

    def make_step(model, x, y, opt_state):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        return jddp.global_mean(loss), eqx.apply_updates(model, updates), opt_state

    rng = np.random.default_rng(1)
    data = [(rng.normal(size=(ROWS, 5, 2)).astype(np.float32), rng.integers(0, 2, (ROWS, 1)).astype(np.float32))]
    data = data * 3
    model = RNN(key=jax.random.key(2))
    results = {}
    for name, step in (
        ("jit", eqx.filter_jit(make_step)),
        ("dp", jddp.data_parallel(make_step, batch_argnums=(1, 2), mesh=_mesh(N))),
    ):
        m, opt_state = model, optim.init(eqx.filter(model, eqx.is_inexact_array))
        for x, y in data:
            loss, m, opt_state = step(m, x, y, opt_state)
        results[name] = (float(loss), m)
    assert results["dp"][1].hidden_size == 8 and results["dp"][1].activation is jax.nn.sigmoid
    assert abs(results["dp"][0] - results["jit"][0]) < 1e-6
    assert _max_diff(eqx.filter(results["dp"][1], eqx.is_array), eqx.filter(results["jit"][1], eqx.is_array)) < 2e-6


def _plain_step(tx):
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p - batch["t"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jddp.global_mean(loss)

    return step


def _plain_args():
    rng = np.random.default_rng(0)
    params = jnp.zeros((6,))
    batch = {"x": rng.normal(size=(ROWS, 6)).astype(np.float32), "t": rng.normal(size=(ROWS,)).astype(np.float32)}
    return params, batch


def test_one_all_reduce_carries_gradients_and_loss():
    tx = optax.chain(jddp.average_gradients(), optax.sgd(0.1))
    params, batch = _plain_args()
    report = jddp.data_parallel(_plain_step(tx), batch_argnums=2, mesh=_mesh(N)).comm_report(
        params, tx.init(params), batch
    )
    assert report.count("all-reduce") == 1, report
    # the gradient (6 floats), the loss and the two weights: a few scalars beside the gradient's bytes
    assert 6 * 4 <= report.nbytes("all-reduce") <= 6 * 4 + 4 * 4, report


def test_a_step_that_averages_nothing_is_refused_naming_the_output():
    """Planted: the chain without average_gradients. The parameters then depend on each device's slice: refused
    at trace time, naming the output, before anything runs (device 0's values are never returned)."""
    tx = optax.sgd(0.1)
    params, batch = _plain_args()
    step = jddp.data_parallel(_plain_step(tx), batch_argnums=2, mesh=_mesh(N))
    with pytest.raises(ValueError, match=r"Output\(s\) \[0\].*differ across devices.*average_gradients"):
        step(params, tx.init(params), batch)


def test_a_metric_left_unaveraged_is_refused_naming_it():
    tx = optax.chain(jddp.average_gradients(), optax.sgd(0.1))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p - batch["t"]) ** 2))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), {"loss": loss}

    params, batch = _plain_args()
    with pytest.raises(ValueError, match=r"\[1\]\['loss'\].*global_mean"):
        jddp.data_parallel(step, batch_argnums=2, mesh=_mesh(N))(params, tx.init(params), batch)


def test_global_mean_is_the_weighted_mean_of_numpy():
    """Against NumPy: per-device means of uneven real counts, averaged exactly (not an average of averages)."""
    rng = np.random.default_rng(4)
    values = rng.normal(size=(ROWS,)).astype(np.float32)
    mask = (rng.random(ROWS) < 0.5).astype(np.float32)
    mask[0] = 1

    def mean_step(batch):
        return jddp.global_mean(jddp.masked_mean(batch["v"], batch["mask"]))

    got = float(jddp.data_parallel(mean_step, batch_argnums=0, mesh=_mesh(N))({"v": values, "mask": mask}))
    np.testing.assert_allclose(got, values[mask == 1].mean(), rtol=1e-6)
    per_device = [values[i : i + 4][mask[i : i + 4] == 1] for i in range(0, ROWS, 4)]
    naive = np.mean([p.mean() for p in per_device if p.size])
    assert abs(naive - values[mask == 1].mean()) > 1e-3  # the case would catch an average of averages


def test_global_mean_outside_a_step_is_the_identity_and_refuses_ints():
    tree = {"a": jnp.ones(3)}
    assert jddp.global_mean(tree) is tree

    def count_step(batch):
        return jddp.global_mean(jnp.sum(batch["mask"].astype(jnp.int32)))

    with pytest.raises(TypeError, match=r"int32.*jax.lax.psum"):
        jddp.data_parallel(count_step, batch_argnums=0, mesh=_mesh(2))({"mask": np.ones(4, np.float32)})


def test_global_mean_inside_the_users_own_shard_map_is_refused():
    mesh = _mesh(2)

    def inner(x):
        return jddp.global_mean(x)

    f = jax.shard_map(inner, mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))
    with pytest.raises(RuntimeError, match="did not set up"):
        f(jnp.ones(4))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"batch_argnums": ()}, ValueError, "at least one"),
        ({"batch_argnums": -1}, TypeError, "non-negative"),
        ({"batch_argnums": (1, 1)}, ValueError, "twice"),
        ({"batch_argnums": 1, "donate_argnums": 1}, ValueError, "both"),
        ({"batch_argnums": 1, "rng": "device"}, ValueError, "rng"),
        ({"batch_argnums": 1, "max_inflight": 0}, ValueError, "max_inflight"),
        ({"batch_argnums": 1, "mesh": "mesh"}, ValueError, "mesh"),
    ],
)
def test_bad_arguments_are_refused_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        jddp.data_parallel(lambda s, b: s, **kwargs)


def test_bad_calls_are_refused_naming_the_argument():
    step = jddp.data_parallel(lambda s, b: s, batch_argnums=1, mesh=_mesh(2))
    with pytest.raises(TypeError, match=r"args\[1\]\['n'\] is int"):
        step(jnp.ones(2), {"x": np.ones((4, 2)), "n": 3})
    with pytest.raises(TypeError, match=r"args\[0\]\['l'\] of .* is set.*hashable"):
        step({"l": {1, 2}}, {"x": np.ones((4, 2))})
    with pytest.raises(ValueError, match="divisible"):
        step(jnp.ones(2), {"x": np.ones((3, 2))})
    with pytest.raises(TypeError, match="positional argument"):
        jddp.data_parallel(lambda s, b: s, batch_argnums=2, mesh=_mesh(2))(1, 2)


def test_donated_state_is_reused_and_named_when_passed_again():
    tx = optax.chain(jddp.average_gradients(), optax.sgd(0.1))
    params, batch = _plain_args()
    step = jddp.data_parallel(_plain_step(tx), batch_argnums=2, mesh=_mesh(2), donate_argnums=(0, 1))
    opt_state = tx.init(params)
    first = step(params, opt_state, batch)
    step(*first[:2], batch)
    dispatch.DISPATCHER.drain()
    with pytest.raises(ValueError, match="donated to an earlier call"):
        step(*first[:2], batch)


def test_a_python_number_in_the_state_is_traced_as_jit_traces_it():
    """Flax's TrainState.create starts `step` at the Python int 0: traced (as jax.jit does), so the step counts on
    the devices and compiles once; a static int would have compiled a program per step and never counted."""
    tx = optax.chain(jddp.average_gradients(), optax.sgd(0.1))
    params, batch = _plain_args()
    state = train_state.TrainState.create(apply_fn=None, params={"w": params}, tx=tx)
    assert state.step == 0 and isinstance(state.step, int)

    def step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((batch["x"] @ p["w"] - batch["t"]) ** 2))(state.params)
        return state.apply_gradients(grads=grads), jddp.global_mean(loss)

    run = jddp.data_parallel(step, batch_argnums=1, mesh=_mesh(2))
    for _ in range(3):
        state, _ = run(state, batch)
    assert isinstance(state.step, jax.Array) and int(state.step) == 3
    assert len(run._programs) == 1
