"""Adapters from Flax models to jddp's ``loss_fn`` contract.

jddp trains any ``loss_fn(params, model_state, batch, rng) -> (loss,
(new_model_state, metrics))``. A plain pytree model writes that directly. For
Flax the split between trainable parameters and the rest (BatchNorm
statistics) is the library's:

* NNX: ``graphdef, params, model_state = jddp.models.nnx_split(model)``, then
  ``jddp.models.nnx_loss(graphdef, fn)`` where ``fn(model, batch, rng)``
  returns the loss, or ``(loss, metrics)``. Use ``nnx.BatchNorm(...,
  axis_name="data")`` for synchronised statistics (SyncBatchNorm).
* Linen: ``params, model_state = jddp.models.linen_split(variables)``, then
  ``jddp.models.linen_loss(module, fn)`` where ``fn(apply, batch, rng)`` calls
  ``apply(*inputs, **kwargs)`` in place of ``module.apply(variables, ...)``;
  every collection of ``model_state`` is mutable, and ``rng`` is passed as
  the ``"dropout"`` stream. Use ``nn.BatchNorm(axis_name="data")``.

Keep RNG state out of NNX models (``nnx.Rngs`` objects): pass ``rng`` to the
layers that need it, so the model state is arrays only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from jddp import typing as jt
from jddp.engine import reduce


def _loss_and_metrics(out) -> tuple[Any, dict]:
    if isinstance(out, tuple) and not isinstance(out, reduce.Weighted) and len(out) == 2:
        loss, metrics = out
        if not isinstance(metrics, dict):
            raise TypeError(f"The loss function's metrics must be a dict, got {type(metrics).__name__}.")
        return loss, metrics
    return out, {}


def nnx_split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """Splits an NNX model into ``(graphdef, params, model_state)``.

    ``params`` are the ``nnx.Param`` variables; ``model_state`` everything else
    (BatchNorm statistics).
    """
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)  # two filters: exactly two states
    return graphdef, params, model_state


def nnx_loss(graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, jt.Batch, Any], Any]) -> jt.LossFn:
    """A jddp ``loss_fn`` from ``fn(model, batch, rng) -> loss | (loss, metrics)``."""

    def loss_fn(params, model_state, batch, rng):
        model = nnx.merge(graphdef, params, model_state, copy=True)
        loss, metrics = _loss_and_metrics(fn(model, batch, rng))
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        return loss, (new_model_state, metrics)

    return loss_fn


def nnx_eval(graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, jt.Batch], jt.Metrics]) -> jt.EvalFn:
    """A jddp ``eval_fn`` from ``fn(model, batch) -> metrics``, with the model in eval mode."""

    def eval_fn(params, model_state, batch):
        model = nnx.merge(graphdef, params, model_state, copy=True)
        model.eval()
        return fn(model, batch)

    return eval_fn


def linen_split(variables: dict) -> tuple[dict, dict]:
    """Splits Linen ``variables`` into ``(params, model_state)``."""
    variables = dict(variables)
    return variables.pop("params"), variables


def linen_loss(module, fn: Callable[[Callable, jt.Batch, Any], Any], *, rng_name: str = "dropout") -> jt.LossFn:
    """A jddp ``loss_fn`` from ``fn(apply, batch, rng) -> loss | (loss, metrics)``."""

    def loss_fn(params, model_state, batch, rng):
        updated = dict(model_state)

        def apply(*args, **kwargs):
            variables = {"params": params, **updated}
            if not updated:
                return module.apply(variables, *args, rngs={rng_name: rng}, **kwargs)
            out, new = module.apply(variables, *args, rngs={rng_name: rng}, mutable=list(updated), **kwargs)
            updated.update(new)
            return out

        loss, metrics = _loss_and_metrics(fn(apply, batch, rng))
        return loss, (updated, metrics)

    return loss_fn
