"""Models with dropout in the three libraries, written as their docs write them, and the global batches they train
on: for the layout-invariant randomness tests (``tests/test_rng.py``, ``tests/workers/dropout.py``)."""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import numpy as np
import optax
from flax import nnx

import jddp
from jddp import models

IN, HIDDEN, OUT, GLOBAL = 12, 32, 4, 32


def xent(logits, batch):
    return jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))


class NNXDropout(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.l1(x))))


def nnx_model():
    graphdef, params, state = models.nnx_split(NNXDropout(nnx.Rngs(0, dropout=1)))
    return models.nnx_loss(graphdef, lambda model, batch, rng: xent(model(batch["x"]), batch)), params, state


class LinenDropout(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(HIDDEN)(x))
        return nn.Dense(OUT)(nn.Dropout(0.3, deterministic=False)(x))


def linen_model():
    params, state = models.linen_split(LinenDropout().init(jax.random.key(2), np.zeros((1, IN), np.float32)))
    return models.linen_loss(LinenDropout(), lambda apply, batch, rng: xent(apply(batch["x"]), batch)), params, state


class EqxDropout(eqx.Module):
    l1: eqx.nn.Linear
    drop: eqx.nn.Dropout
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(IN, HIDDEN, key=k1)
        self.drop = eqx.nn.Dropout(0.3)
        self.l2 = eqx.nn.Linear(HIDDEN, OUT, key=k2)

    def __call__(self, x, key):
        return self.l2(self.drop(jax.nn.relu(self.l1(x)), key=key))


def eqx_model():
    static, params, state = models.eqx_split(EqxDropout(jax.random.key(4)))

    def fn(model, state, batch, key):
        keys = jax.random.split(key, batch["x"].shape[0])  # one key per example, as Equinox's examples do
        return xent(jax.vmap(model)(batch["x"], keys), batch), state

    return models.eqx_loss(static, fn), params, state


FACTORIES = {"nnx": nnx_model, "linen": linen_model, "equinox": eqx_model}


def host_batches(count: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        x = rng.normal(size=(GLOBAL, IN)).astype(np.float32)
        out.append({"x": x, "y": (x[:, 0] > 0).astype(np.int32) + 2 * (x[:, 1] > 0).astype(np.int32)})
    return out


def train(dp, state, batches):
    losses = []
    for b in batches:
        state, metrics = dp.step(state, b)
        losses.append(float(metrics["loss"]))
    return state, losses


def optimizer():
    return optax.adam(1e-2)


def make_dp(loss_fn, mesh, rng: str = "example"):
    return jddp.DataParallel(loss_fn, optimizer(), mesh=mesh, rng=rng)
