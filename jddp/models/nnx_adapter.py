"""The adapters of Flax NNX models: ``nnx_split``, ``nnx_loss``, ``nnx_eval``, ``nnx_module``, and the ``nnx.Rngs``
streams they keep in ``model_state`` as raw key data, drawn afresh from jddp's ``rng`` at every step."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jddp import typing as jt
from jddp.models import checks
from jddp.models import host as host_lib
from jddp.runtime import state as state_lib


def nnx_split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """Splits an NNX model into ``(graphdef, params, model_state)``.

    ``params`` are the ``nnx.Param`` variables; ``model_state`` everything else
    (BatchNorm statistics).

    Raises:
      TypeError: ``model`` is not an ``nnx.Module`` (a Linen or Equinox model is named as such).
    """
    checks.check_of("nnx_split", "model", model, "nnx", nnx.Module, "an nnx.Module")
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)  # two filters: exactly two states
    model_state = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, model_state)
    return graphdef, params, model_state


def nnx_loss(graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, jt.Batch, Any], Any]) -> jt.LossFn:
    """A jddp ``loss_fn`` from ``fn(model, batch, rng) -> loss | (loss, metrics)``, the model in train mode and
    its ``nnx.Rngs`` streams drawn from ``rng`` (see the module docstring).

    Raises:
      TypeError: ``graphdef`` is not an NNX graphdef, or ``fn`` is not a function.
    """
    checks.check_of("nnx_loss", "graphdef", graphdef, "nnx", nnx.GraphDef, checks.GRAPHDEF_PART)
    checks.check_fn("nnx_loss", fn, "fn(model, batch, rng) -> loss | (loss, metrics)")

    def loss_fn(params, model_state, batch, rng):
        model = nnx.merge(graphdef, params, _reseeded(model_state, rng), copy=True)
        model.train()
        loss, metrics = checks.loss_and_metrics(fn(model, batch, rng))
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        return loss, (_streams_kept(new_model_state, model_state), metrics)

    return loss_fn


def nnx_eval(graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, jt.Batch], jt.Metrics]) -> jt.EvalFn:
    """A jddp ``eval_fn`` from ``fn(model, batch) -> metrics``, with the model in eval mode.

    Raises:
      TypeError: ``graphdef`` is not an NNX graphdef, or ``fn`` is not a function.
    """
    checks.check_of("nnx_eval", "graphdef", graphdef, "nnx", nnx.GraphDef, checks.GRAPHDEF_PART)
    checks.check_fn("nnx_eval", fn, "fn(model, batch) -> metrics")

    def eval_fn(params, model_state, batch):
        model = nnx.merge(graphdef, params, model_state, copy=True)
        model.eval()
        return fn(model, batch)

    return eval_fn


def nnx_module(graphdef: nnx.GraphDef, state: state_lib.TrainState) -> nnx.Module:
    """The trained NNX module of ``state`` on the host, in eval mode (``.train()`` switches it back).

    Raises:
      TypeError: ``graphdef`` is not an NNX graphdef, or ``state`` not a live ``TrainState``.
      ValueError: ``state`` holds another model's parameters than ``graphdef``'s.
    """
    checks.check_of("nnx_module", "graphdef", graphdef, "nnx", nnx.GraphDef, checks.GRAPHDEF_PART)
    checks.check_train_state("nnx_module", state)
    try:
        model = nnx.merge(graphdef, host_lib.to_host(state.params), _typed_keys(host_lib.to_host(state.model_state)))
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`nnx_module`'s `state` does not hold the model of `graphdef`: nnx.merge could not put its params and "
            f"model_state into it ({checks.first_line(error)}). Pass the graphdef that nnx_split gave with the params "
            "of this state."
        ) from None
    model.eval()
    return model


def _typed_keys(model_state):
    """``model_state`` with each ``nnx.Rngs`` stream's key typed again (``nnx_split`` keeps it as raw uint32 key
    data, which a state of arrays can hold), so that the module's streams draw as before it was split."""
    if not isinstance(model_state, nnx.State):
        return model_state
    flat = []
    for path, variable in nnx.to_flat_state(model_state):
        if isinstance(variable, nnx.RngKey) and not _is_key(variable.get_value()):
            variable = variable.replace(jax.random.wrap_key_data(jnp.asarray(variable.get_value())))
        flat.append((path, variable))
    return nnx.from_flat_state(flat)


def _is_key(x) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _reseeded(model_state, rng):
    """``model_state`` with every ``nnx.Rngs`` stream's key drawn from ``rng`` and the stream's path, and its
    counter 0."""
    if not isinstance(model_state, nnx.State):
        return model_state
    flat = []
    for path, variable in nnx.to_flat_state(model_state):
        if isinstance(variable, nnx.RngKey):
            salt = zlib.crc32("/".join(map(str, path)).encode()) & 0x7FFFFFFF
            variable = variable.replace(jax.random.key_data(jax.random.fold_in(rng, salt)))
        elif isinstance(variable, nnx.RngCount):
            variable = variable.replace(jnp.zeros_like(variable.get_value()))
        flat.append((path, variable))
    return nnx.from_flat_state(flat)


def _streams_kept(new_model_state, model_state):
    """``new_model_state`` with the ``nnx.Rngs`` streams of ``model_state``: they are drawn afresh each step."""
    if not isinstance(model_state, nnx.State):
        return new_model_state
    old = dict(nnx.to_flat_state(model_state))
    flat = [
        (path, old[path] if isinstance(variable, nnx.RngState) else variable)
        for path, variable in nnx.to_flat_state(new_model_state)
    ]
    return nnx.from_flat_state(flat)
