"""Small models of the three kinds jddp trains, each with a single-device twin.

Every factory returns a ``Model``: jddp's ``loss_fn`` (SyncBatchNorm over
``"data"`` where the model has BatchNorm), the same loss for one device on the
whole global batch (``ref_loss_fn``, no axis name), initial params and model
state.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jddp
from jddp import models

IN, HIDDEN, OUT = 12, 16, 4


@dataclasses.dataclass
class Model:
    loss_fn: Callable
    ref_loss_fn: Callable
    params: Any
    model_state: Any
    pmap_loss_fn: Callable | None = None  # the loss for `pmap_sgd` when it must not use jddp's adapter


def max_diff(a, b) -> float:
    """The largest absolute difference between two pytrees of arrays; NaN if either holds a NaN."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    diffs = [np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0) for x, y in pairs]
    return float(np.max(diffs, initial=0.0))


def batch(n: int, seed: int = 0, mask: np.ndarray | None = None) -> dict:
    rng = np.random.default_rng(seed)
    out = {"x": rng.normal(size=(n, IN)).astype(np.float32), "y": rng.integers(0, OUT, size=(n,)).astype(np.int32)}
    if mask is not None:
        out["mask"] = np.asarray(mask, np.float32)
    return out


def classification(logits, batch):
    mask = batch.get("mask")
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)
    accuracy = jddp.masked_mean((jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32), mask)
    return loss, {"accuracy": accuracy}


def pytree() -> Model:
    rng = np.random.default_rng(1)
    params = {
        "w1": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (rng.normal(size=(HIDDEN, OUT)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(OUT, np.float32),
    }

    def loss_fn(params, model_state, batch, rng):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
        loss, metrics = classification(h @ params["w2"] + params["b2"][None, :], batch)
        return loss, (model_state, metrics)

    return Model(loss_fn, loss_fn, params, {})


class LinenMLP(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(HIDDEN)(x)
        x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x)
        return nn.Dense(OUT)(nn.relu(x))


def linen() -> Model:
    """jddp's Linen adapter, against references written with Flax's own ``apply`` (not the adapter)."""
    variables = LinenMLP().init(jax.random.key(2), np.zeros((1, IN), np.float32))
    params, model_state = models.linen_split(variables)

    def fn(apply, batch, rng):
        return classification(apply(batch["x"]), batch)

    def flax_loss(module):
        def loss_fn(params, model_state, batch, rng):
            logits, new_state = module.apply({"params": params, **model_state}, batch["x"], mutable=["batch_stats"])
            loss, metrics = classification(logits, batch)
            return loss, (dict(new_state), metrics)

        return loss_fn

    loss_fn = models.linen_loss(LinenMLP(axis_name=jddp.DATA_AXIS), fn)
    return Model(loss_fn, flax_loss(LinenMLP()), params, model_state, flax_loss(LinenMLP(axis_name=jddp.DATA_AXIS)))


class NNXMLP(nnx.Module):
    def __init__(self, axis_name: str | None, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.bn = nnx.BatchNorm(HIDDEN, momentum=0.9, axis_name=axis_name, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def nnx_model() -> Model:
    graphdef, params, model_state = models.nnx_split(NNXMLP(jddp.DATA_AXIS, nnx.Rngs(3)))
    ref_graphdef, _, _ = models.nnx_split(NNXMLP(None, nnx.Rngs(3)))

    def fn(model, batch, rng):
        return classification(model(batch["x"]), batch)

    return Model(models.nnx_loss(graphdef, fn), models.nnx_loss(ref_graphdef, fn), params, model_state)


class EqxMLP(eqx.Module):
    """Linear, LayerNorm, Linear: Equinox's own layers, params only."""

    l1: eqx.nn.Linear
    norm: eqx.nn.LayerNorm
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(IN, HIDDEN, key=k1)
        self.norm = eqx.nn.LayerNorm(HIDDEN)
        self.l2 = eqx.nn.Linear(HIDDEN, OUT, key=k2)

    def __call__(self, x):
        return jax.vmap(lambda v: self.l2(jax.nn.relu(self.norm(self.l1(v)))))(x)


def eqx_model() -> Model:
    """jddp's Equinox adapter, against a reference written with ``eqx.combine`` (not the adapter)."""
    model = EqxMLP(jax.random.key(4))
    static, params, model_state = models.eqx_split(model)

    def fn(model, state, batch, key):
        loss, metrics = classification(model(batch["x"]), batch)
        return loss, state, metrics

    def eqx_loss_fn(params, model_state, batch, rng):
        loss, metrics = classification(eqx.combine(params, static)(batch["x"]), batch)
        return loss, (model_state, metrics)

    return Model(models.eqx_loss(static, fn), eqx_loss_fn, params, model_state)


def odd() -> Model:
    """An MLP none of whose widths 8 divides (12 -> 20 -> 5), its logits scaled by a learned scalar: on 8 devices
    every optimizer-state leaf is padded, but the scalar's."""
    rng = np.random.default_rng(3)
    params = {
        "w1": (rng.normal(size=(12, 20)) / np.sqrt(12)).astype(np.float32),
        "b1": np.zeros(20, np.float32),
        "w2": (rng.normal(size=(20, 5)) / np.sqrt(20)).astype(np.float32),
        "b2": np.zeros(5, np.float32),
        "t": np.ones((), np.float32),  # a scalar: a leaf too small to split, all-reduced whole
    }

    def loss_fn(params, model_state, batch, rng):
        h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"][None, :])
        loss, metrics = classification((h @ params["w2"] + params["b2"][None, :]) * params["t"], batch)
        return loss, (model_state, metrics)

    return Model(loss_fn, loss_fn, params, {})


def uneven_mask(n: int, seed: int, devices: int) -> np.ndarray:
    """Real examples spread unevenly over ``devices``: the first device's slice all padding, the others a random
    part."""
    mask = (np.random.default_rng(100 + seed).random(n) < 0.6).astype(np.float32)
    mask[: n // devices] = 0
    return mask


FACTORIES = {"pytree": pytree, "linen": linen, "nnx": nnx_model, "equinox": eqx_model}


def reference_sgd(model: Model, batches: list[dict], lr: float):
    """Plain SGD on one device over whole global batches: the independent reference."""

    @jax.jit
    def step(params, model_state, batch):
        grad_fn = jax.value_and_grad(model.ref_loss_fn, has_aux=True)
        (loss, (model_state, _)), grads = grad_fn(params, model_state, batch, jax.random.key(0))
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), model_state, loss

    params, model_state = model.params, model.model_state
    for b in batches:
        params, model_state, _ = step(params, model_state, b)
    return params, model_state


def pmap_sgd(model: Model, batches: list[dict], lr: float, n: int):
    """The classic ``jax.pmap`` formulation: per-device grads, ``pmean``, SGD."""

    def step(params, model_state, batch):
        grad_fn = jax.value_and_grad(model.pmap_loss_fn or model.loss_fn, has_aux=True)
        (_, (model_state, _)), grads = grad_fn(params, model_state, batch, jax.random.key(0))
        grads = jax.lax.pmean(grads, jddp.DATA_AXIS)
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), model_state

    pstep = jax.pmap(step, axis_name=jddp.DATA_AXIS, devices=jax.devices()[:n])
    stack = lambda t: jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (n, *np.shape(x))), t)
    params, model_state = stack(model.params), stack(model.model_state)
    for b in batches:
        split = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), b)
        params, model_state = pstep(params, model_state, split)
        jax.block_until_ready(params)
    return jax.tree.map(lambda x: np.asarray(x[0]), params), jax.tree.map(lambda x: np.asarray(x[0]), model_state)


def flat(tree) -> dict[str, np.ndarray]:
    """A pytree's leaves as host arrays by key path (for ``np.savez``)."""
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree.leaves_with_path(tree)}


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """A list that collects one entry per XLA backend compilation while the block runs."""
    compiles: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
