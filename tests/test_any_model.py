"""Any model that trains under plain ``jax.jit`` trains unchanged in ``DataParallel``'s step and eval step.

Each model is written as its library's own docs write it, with a loop or branch whose state starts from a
constant (a ``lax.scan``/``fori_loop``/``while_loop`` carry from ``jnp.zeros``, a ``cond`` with a constant
branch): under ``shard_map(check_vma=True)`` JAX refused every one of them ("carry input and carry output must
have equal types"). Each trains on 8 devices and is compared with plain SGD under ``jax.jit`` on one device
over the same global batches.

The engine learns which model-state leaves differ across devices from the program's jaxpr
(``jddp.engine.varying``); the last tests pin what that analysis must say for each kind of leaf.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jddp
from jddp import models
from jddp.engine import varying
from tests.models import max_diff

GLOBAL, SEQ, FEAT, HID, OUT, STEPS, LR = 32, 6, 3, 8, 4, 3, 0.5


def batches(seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        x = rng.normal(size=(GLOBAL, SEQ, FEAT)).astype(np.float32)
        # A label the models can learn: the quartile of the sequence's sum of its first feature.
        y = np.digitize(x[:, :, 0].sum(1), [-1.0, 0.0, 1.0]).astype(np.int32)
        out.append({"x": x, "y": y})
    return out


def xent(logits, batch):
    return jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))


# --- Equinox: a GRU over the sequence, as Equinox's train_rnn example writes it -------------------------------


class EqxRNN(eqx.Module):
    hidden_size: int
    cell: eqx.nn.GRUCell
    linear: eqx.nn.Linear

    def __init__(self, key):
        ckey, lkey = jax.random.split(key)
        self.hidden_size = HID
        self.cell = eqx.nn.GRUCell(FEAT, HID, key=ckey)
        self.linear = eqx.nn.Linear(HID, OUT, key=lkey)

    def __call__(self, xs):
        hidden = jnp.zeros((self.hidden_size,))

        def f(carry, inp):
            return self.cell(inp, carry), None

        out, _ = lax.scan(f, hidden, xs)
        return self.linear(out)


def equinox_case():
    static, params, state = models.eqx_split(EqxRNN(jax.random.key(0)))

    def fn(model, state, batch, key):
        return xent(jax.vmap(model)(batch["x"]), batch), state

    def plain(params, batch):
        return xent(jax.vmap(eqx.combine(params, static))(batch["x"]), batch)

    return models.eqx_loss(static, fn), plain, params, state


# --- Flax NNX: a stack of blocks created with nnx.vmap and applied with nnx.scan (Flax's scan-over-layers) -----


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(HID, HID, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class NNXStack(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Linear(SEQ * FEAT, HID, rngs=rngs)

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return Block(rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(HID, OUT, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(self.embed(x.reshape(x.shape[0], -1)), self.blocks))


def nnx_case():
    graphdef, params, state = models.nnx_split(NNXStack(nnx.Rngs(1)))

    def plain(params, batch):
        return xent(nnx.merge(graphdef, params, state, copy=True)(batch["x"]), batch)

    return models.nnx_loss(graphdef, lambda model, batch, rng: xent(model(batch["x"]), batch)), plain, params, state


# --- Flax Linen: nn.RNN over a GRU cell ------------------------------------------------------------------------


class LinenRNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.RNN(nn.GRUCell(features=HID))(x)  # its initial carry: the cell's zeros
        return nn.Dense(OUT)(h[:, -1])


def linen_case():
    variables = LinenRNN().init(jax.random.key(2), np.zeros((1, SEQ, FEAT), np.float32))
    params, state = models.linen_split(variables)

    def plain(params, batch):
        return xent(LinenRNN().apply({"params": params}, batch["x"]), batch)

    return models.linen_loss(LinenRNN(), lambda apply, batch, rng: xent(apply(batch["x"]), batch)), plain, params, state


# --- Plain pytrees: fori_loop, while_loop and cond whose state starts from constants ---------------------------


def pytree_params(seed: int = 3) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "wx": (rng.normal(size=(FEAT, HID)) / np.sqrt(FEAT)).astype(np.float32),
        "wh": (rng.normal(size=(HID, HID)) / np.sqrt(HID)).astype(np.float32),
        "wo": (rng.normal(size=(HID, OUT)) / np.sqrt(HID)).astype(np.float32),
        "gate": np.ones((), np.float32),
    }


def fori_logits(params, x):
    """An RNN written with ``fori_loop`` over time, from a zero state."""
    x = jnp.asarray(x)

    def body(t, h):
        return jnp.tanh(x[:, t] @ params["wx"] + h @ params["wh"])

    return lax.fori_loop(0, SEQ, body, jnp.zeros((x.shape[0], HID))) @ params["wo"]


def while_logits(params, x):
    """A fixed-point iteration whose stopping test reads the data: a ``while_loop`` from constants. Reverse-mode
    differentiation does not go through a ``while_loop`` (under plain jit neither), so its result scales the
    logits as a constant (``stop_gradient``), as a data-dependent normaliser would."""

    def cond(carry):
        i, err, _ = carry
        return (i < 20) & (err > 1e-3)

    def body(carry):
        i, _, s = carry
        new = 0.5 * (s + jnp.mean(x**2) / s)
        return i + 1, jnp.abs(new - s), new

    _, _, scale = lax.while_loop(cond, body, (0, jnp.asarray(1.0), jnp.asarray(1.0)))
    return fori_logits(params, x) / lax.stop_gradient(1.0 + 0.0 * scale)


def cond_logits(params, x):
    """A ``cond`` on a parameter with a constant branch (no hidden state when the gate is closed)."""
    h0 = lax.cond(params["gate"] > 0, lambda: jnp.tanh(x[:, 0] @ params["wx"]), lambda: jnp.zeros((x.shape[0], HID)))
    h = jnp.tanh(x[:, 1] @ params["wx"] + h0 @ params["wh"])
    return h @ params["wo"]


def pytree_case(logits_fn):
    def loss_fn(params, model_state, batch, rng):
        return xent(logits_fn(params, batch["x"]), batch), (model_state, {})

    return loss_fn, lambda params, batch: xent(logits_fn(params, batch["x"]), batch), pytree_params(), {}


CASES = {
    "equinox-gru-scan": equinox_case,
    "nnx-scan-layer-stack": nnx_case,
    "linen-nn-rnn": linen_case,
    "fori-loop": lambda: pytree_case(fori_logits),
    "while-loop": lambda: pytree_case(while_logits),
    "cond-constant-branch": lambda: pytree_case(cond_logits),
}


def plain_jit_sgd(plain, params, data):
    """The reference: SGD under plain ``jax.jit`` on one device, on whole global batches."""
    step = jax.jit(lambda p, b: jax.tree.map(lambda w, g: w - LR * g, p, jax.grad(plain)(p, b)))
    for b in data:
        params = step(params, b)
    return params


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_model_with_a_loop_from_constants_trains_like_plain_jit(name):
    loss_fn, plain, params, state = CASES[name]()
    data = batches()
    dp = jddp.DataParallel(loss_fn, optax.sgd(LR), mesh=jddp.data_mesh())
    assert dp.num_devices == 8
    train = dp.init(params, model_state=state, rng=0)
    for b in data:
        train, _ = dp.step(train, b)
    expected = plain_jit_sgd(plain, params, data)
    assert max_diff(jddp.models.to_host(train.params), expected) < 1e-6
    # It learns (the comparison is not between two models that did not move):
    assert float(plain(expected, data[0])) < float(plain(params, data[0]))
    evaluated = dp.eval_step(train, data[0])  # the eval step traces the same model
    assert abs(evaluated["loss"] - float(plain(expected, data[0]))) < 1e-5


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_accumulation_with_a_scan_model_equals_plain_jit():
    loss_fn, plain, params, state = equinox_case()
    data = batches(1)
    dp = jddp.DataParallel(loss_fn, optax.sgd(LR), mesh=jddp.data_mesh(), accumulate_steps=2)
    train = dp.init(params, model_state=state, rng=0)
    for b in data:
        train, _ = dp.step(train, b)
    assert max_diff(jddp.models.to_host(train.params), plain_jit_sgd(plain, params, data)) < 1e-6


def test_sharded_optimizer_with_a_scan_model_equals_plain_jit():
    loss_fn, plain, params, state = CASES["fori-loop"]()
    data = batches(2)
    dp = jddp.DataParallel(loss_fn, optax.sgd(LR), mesh=jddp.data_mesh(), shard_optimizer=True)
    train = dp.init(params, model_state=state, rng=0)
    for b in data:
        train, _ = dp.step(train, b)
    assert max_diff(jddp.models.to_host(train.params), plain_jit_sgd(plain, params, data)) < 1e-6


# --- What the variance analysis must say about model state -----------------------------------------------------


def stats_case(stat):
    """A linear model whose model state holds one statistic of the batch, computed by ``stat(x, model_state)``."""
    params = {"w": np.full((FEAT, OUT), 0.1, np.float32)}

    def loss_fn(params, model_state, batch, rng):
        x = batch["x"][:, 0]
        return xent(x @ params["w"], batch), (stat(x, model_state), {})

    return loss_fn, params


def run_one_step(loss_fn, params, model_state, batch):
    dp = jddp.DataParallel(loss_fn, optax.sgd(LR), mesh=jddp.data_mesh())
    train, _ = dp.step(dp.init(params, model_state=model_state, rng=0), batch)
    return jddp.models.to_host(train.model_state)


def test_a_statistic_of_the_local_batch_is_averaged_to_the_global_one():
    loss_fn, params = stats_case(lambda x, ms: {"mean": jnp.mean(x, 0), "count": ms["count"] + 1})
    b = batches()[0]
    out = run_one_step(loss_fn, params, {"mean": np.zeros(FEAT, np.float32), "count": np.int32(5)}, b)
    np.testing.assert_allclose(out["mean"], b["x"][:, 0].mean(0), atol=1e-6)  # equal slices: mean of means
    assert out["count"] == 6  # computed from replicated values: kept, not refused


def test_a_statistic_synchronised_by_the_model_is_left_as_it_is():
    """``lax.pmean`` inside the model (SyncBatchNorm) makes a value the same everywhere: not averaged again."""

    def stat(x, ms):
        return {"mean": lax.pmean(jnp.mean(x, 0), jddp.DATA_AXIS)}

    loss_fn, params = stats_case(stat)
    b = batches()[0]
    closed = jax.make_jaxpr(lambda x: stat(x, {}), axis_env=[(jddp.DATA_AXIS, 8)])(b["x"][:4, 0])
    assert varying.varying_outputs(closed, [True], jddp.DATA_AXIS) == [False]
    out = run_one_step(loss_fn, params, {"mean": np.zeros(FEAT, np.float32)}, b)
    np.testing.assert_allclose(out["mean"], b["x"][:, 0].mean(0), atol=1e-6)


def test_an_integer_computed_from_the_batch_is_refused_by_name():
    loss_fn, params = stats_case(lambda x, ms: {"hits": jnp.sum(x > 0).astype(jnp.int32)})
    with pytest.raises(ValueError, match=r"model_state\['hits'\].*differs across devices"):
        run_one_step(loss_fn, params, {"hits": np.int32(0)}, batches()[0])


def test_a_counter_inside_a_scan_over_the_batch_stays_replicated():
    """A scan carrying both the data and a counter: the counter's flag must not catch the data's."""

    def stat(x, ms):
        def body(carry, row):
            total, n = carry
            return (total + row, n + 1), None

        (total, n), _ = lax.scan(body, (jnp.zeros(FEAT), ms["n"]), x)
        return {"n": n, "sum": total}

    loss_fn, params = stats_case(stat)
    b = batches()[0]
    out = run_one_step(loss_fn, params, {"n": np.int32(0), "sum": np.zeros(FEAT, np.float32)}, b)
    assert out["n"] == GLOBAL // 8  # each device counted its own rows, the same number everywhere
    np.testing.assert_allclose(out["sum"], b["x"][:, 0].sum(0) / 8, atol=1e-5)  # averaged: the mean of the sums


@pytest.mark.parametrize(
    ("name", "fn", "expected"),
    [
        ("axis_index", lambda x: lax.axis_index(jddp.DATA_AXIS) * 1.0, [True]),
        ("psum", lambda x: lax.psum(x, jddp.DATA_AXIS), [False]),
        ("all_gather", lambda x: lax.all_gather(x, jddp.DATA_AXIS), [False]),
        ("psum_scatter", lambda x: lax.psum_scatter(jnp.ones(8), jddp.DATA_AXIS, tiled=True), [True]),
        ("constant", lambda x: jnp.zeros(3), [False]),
        ("cond-on-data", lambda x: lax.cond(x.sum() > 0, lambda: 1.0, lambda: 2.0), [True]),
        ("cond-on-constant", lambda x: lax.cond(True, lambda: 1.0, lambda: x.sum()), [True]),
        ("while-on-data", lambda x: lax.while_loop(lambda c: c < x.sum(), lambda c: c + 1.0, 0.0), [True]),
        ("while-constant", lambda x: lax.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, 0.0), [False]),
        ("jit", lambda x: jax.jit(lambda y: (y * 2, jnp.ones(2)))(x), [True, False]),
        ("checkpoint", lambda x: jax.checkpoint(lambda y: (y * 2, jnp.ones(2)))(x), [True, False]),
        ("custom_jvp", lambda x: jax.nn.relu(x), [True]),
        ("scan-split", lambda x: lax.scan(lambda c, r: ((c[0] + r, c[1] + 1), None), (0.0, 0), x)[0], [True, False]),
    ],
)
def test_varying_outputs_of_each_kind_of_equation(name, fn, expected):
    closed = jax.make_jaxpr(fn, axis_env=[(jddp.DATA_AXIS, 8)])(jnp.ones(4))
    assert varying.varying_outputs(closed, [True], jddp.DATA_AXIS) == expected, name


def test_an_error_in_user_code_shows_the_users_arrays_not_the_packed_batch():
    """A batch from ``jddp.data.DataLoader`` travels packed in one ``uint8`` buffer; the note on an error in the
    user's loss names the arrays the loss sees."""
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(64, SEQ, FEAT)).astype(np.float32), "y": np.zeros(64, np.int32)}
    loader = jddp.data.DataLoader(data, global_batch_size=32, seed=0)
    batch = next(iter(loader))

    def loss_fn(params, model_state, batch, rng):
        return xent(batch["x"] @ params["w"], batch), (model_state, {})  # x is [B, SEQ, FEAT]: a shape mistake

    dp = jddp.DataParallel(loss_fn, optax.sgd(LR), mesh=jddp.data_mesh())
    with pytest.raises(TypeError) as error:
        dp.step(dp.init({"w": np.zeros((SEQ, OUT), np.float32)}, rng=0), batch)
    note = "\n".join(getattr(error.value, "__notes__", []))
    assert "['x']: float32[4, 6, 3], ['y']: int32[4]" in note, note
    assert "uint8" not in note, note


class EqxBN(eqx.Module):
    """Equinox's stateful BatchNorm as Equinox's docs write it (``make_with_state``, a vmapped batch axis), its
    statistics synchronised over the devices too by naming jddp's axis beside the batch's."""

    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key, axis_name):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(SEQ * FEAT, HID, key=k1)
        self.bn = eqx.nn.BatchNorm(HID, axis_name=axis_name, mode="ema")  # its first_time flag: a constant
        self.l2 = eqx.nn.Linear(HID, OUT, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(jax.nn.relu(self.l1(x.reshape(-1))), state)
        return self.l2(h), state


def test_equinox_batchnorm_trains_like_plain_jit():
    """``State.set`` compares the new value's ``eval_shape`` with the old one's: inside ``shard_map`` an argument
    carried the manual mesh's sharding and a constant none, and Equinox refused the update ("Old and new values
    have different structures/shapes/dtypes ... bool[] and ... bool[]"). jddp traces the loss as plain jit would."""
    data = batches(4)
    model, state = eqx.nn.make_with_state(EqxBN)(jax.random.key(5), ("batch", jddp.DATA_AXIS))
    ref_model, ref_state = eqx.nn.make_with_state(EqxBN)(jax.random.key(5), "batch")
    static, params, model_state = models.eqx_split(model, state)
    ref_static, ref_params, _ = models.eqx_split(ref_model, ref_state)

    def forward(model, state, x):
        return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)

    def fn(model, state, batch, key):
        logits, state = forward(model, state, batch["x"])
        return xent(logits, batch), state

    dp = jddp.DataParallel(models.eqx_loss(static, fn), optax.sgd(LR), mesh=jddp.data_mesh())
    train = dp.init(params, model_state=model_state, rng=0)
    for b in data:
        train, _ = dp.step(train, b)

    @jax.jit
    def plain_step(params, state, batch):
        def loss(p):
            logits, new_state = forward(eqx.combine(p, ref_static), state, batch["x"])
            return xent(logits, batch), new_state

        (_, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return jax.tree.map(lambda w, g: w - LR * g, params, grads), state

    ref_model_state = ref_state
    for b in data:
        ref_params, ref_model_state = plain_step(ref_params, ref_model_state, b)
    assert max_diff(jddp.models.to_host(train.params), ref_params) < 1e-5
    assert max_diff(jddp.models.to_host(train.model_state), ref_model_state) < 1e-5
