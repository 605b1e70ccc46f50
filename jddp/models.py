"""Adapters from Flax and Equinox models to jddp's ``loss_fn`` contract.

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
* Equinox (``pip install jddp[equinox]``): ``static, params, model_state =
  jddp.models.eqx_split(*eqx.nn.make_with_state(Model)(...))``, then
  ``jddp.models.eqx_loss(static, fn)`` where ``fn(model, state, batch, key)``
  returns ``(loss, state)`` or ``(loss, state, metrics)``. BatchNorm's
  statistics over the whole global batch: ``eqx.nn.BatchNorm(...,
  axis_name=("batch", "data"), mode="batch")`` under ``jax.vmap(...,
  axis_name="batch")``.

Modes: ``nnx_loss`` runs the model in train mode (``model.train()``: dropout on,
BatchNorm on batch statistics) and ``nnx_eval`` in eval mode, whatever mode the
model was in when it was split. Linen modules take their mode as an argument
of ``apply`` (``train=True``), which ``fn`` passes.

Randomness: jddp's ``rng`` differs at every step; with ``DataParallel(rng="example")`` (the default) each
example's draws are those it would get on one device, on any device layout (``jddp.engine.rng``). An NNX
model that holds ``nnx.Rngs`` (``nnx.Dropout(rate, rngs=rngs)``, the usual NNX
style) keeps them: ``nnx_split`` stores their keys as raw key data in
``model_state`` (so that the state is arrays, broadcast, digested and saved like
any other), and at every step ``nnx_loss`` replaces each stream's key by one
drawn from jddp's ``rng`` and the stream's path, and its counter by 0. So every
layer, example and step gets its own masks, a run is reproducible and resumes
exactly, and the streams in ``model_state`` never change (they do not advance
as a plain NNX loop's would: a per-device counter could not be kept replicated).
A ``fn`` that uses ``rng`` itself must split it between layers: the same key
gives the same mask.

Back from a ``TrainState``: ``nnx_module(graphdef, state)`` is the trained NNX
module on the host (eval mode), ``linen_variables(state)`` the Linen variables,
``to_host(tree)`` any part of a state as NumPy; each process reads its own
replica, with no communication. A module built with ``axis_name="data"``
(synchronised BatchNorm) runs outside jddp in eval mode only.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jddp import typing as jt
from jddp.engine import reduce
from jddp.runtime import state as state_lib


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
    model_state = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, model_state)
    return graphdef, params, model_state


def nnx_loss(graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, jt.Batch, Any], Any]) -> jt.LossFn:
    """A jddp ``loss_fn`` from ``fn(model, batch, rng) -> loss | (loss, metrics)``, the model in train mode and
    its ``nnx.Rngs`` streams drawn from ``rng`` (see the module docstring)."""

    def loss_fn(params, model_state, batch, rng):
        model = nnx.merge(graphdef, params, _reseeded(model_state, rng), copy=True)
        model.train()
        loss, metrics = _loss_and_metrics(fn(model, batch, rng))
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        return loss, (_streams_kept(new_model_state, model_state), metrics)

    return loss_fn


def nnx_eval(graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, jt.Batch], jt.Metrics]) -> jt.EvalFn:
    """A jddp ``eval_fn`` from ``fn(model, batch) -> metrics``, with the model in eval mode."""

    def eval_fn(params, model_state, batch):
        model = nnx.merge(graphdef, params, model_state, copy=True)
        model.eval()
        return fn(model, batch)

    return eval_fn


def nnx_module(graphdef: nnx.GraphDef, state: state_lib.TrainState) -> nnx.Module:
    """The trained NNX module of ``state`` on the host, in eval mode (``.train()`` switches it back)."""
    model = nnx.merge(graphdef, to_host(state.params), _typed_keys(to_host(state.model_state)))
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


def linen_variables(state: state_lib.TrainState) -> dict:
    """The Linen variables of ``state`` on the host: ``module.apply(linen_variables(state), x, train=False)``."""
    return {"params": to_host(state.params), **to_host(state.model_state)}


def to_host(tree):
    """``tree`` (params, model state, a whole ``TrainState``) as NumPy arrays of their own (writable copies),
    read from this process's own replica: no communication, on any process.

    Raises:
      ValueError: a leaf is split over several processes (the optimizer state of ``shard_optimizer=True``
        across processes), so that no process holds it whole; names the leaf and the fix.
    """

    def host(path, x):
        if not isinstance(x, jax.Array):
            return x
        if x.is_fully_replicated:
            return np.array(x.addressable_shards[0].data)
        if not x.is_fully_addressable:
            raise ValueError(
                f"to_host reads this process's own copy, but the leaf {jax.tree_util.keystr(path)} (shape "
                f"{x.shape}, {x.sharding}) is split over several processes: no process holds it whole. Read the "
                "replicated parts (to_host(state.params), to_host(state.model_state)); the optimizer state of "
                "shard_optimizer=True is in the checkpoint, or gather it on every process at once with "
                "jax.experimental.multihost_utils.process_allgather."
            )
        return np.array(x)

    return jax.tree_util.tree_map_with_path(host, tree)


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


def linen_split(variables: Mapping) -> tuple[dict, dict]:
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


def eqx_split(model, state=None) -> tuple[Any, jt.Params, Any]:
    """Splits an Equinox model into ``(static, params, model_state)``.

    ``params`` are the model's floating-point arrays (``eqx.partition(model,
    eqx.is_inexact_array)``), ``static`` everything else, and ``model_state`` is
    ``state``: the ``eqx.nn.State`` of ``eqx.nn.make_with_state`` (BatchNorm's
    statistics), or ``{}`` for a model without one.
    """
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_inexact_array)
    return static, params, {} if state is None else state


def eqx_loss(static, fn: Callable[..., Any]) -> jt.LossFn:
    """A jddp ``loss_fn`` from an Equinox loss, in one of two forms, told apart by ``fn``'s number of positional
    parameters (``inspect.signature``):

    * 3, ``fn(model, batch, key) -> loss | (loss, metrics)``: for a model without ``eqx.nn.State`` (split with
      ``eqx_split(model)``); the model state stays ``{}``;
    * 4, ``fn(model, state, batch, key) -> (loss, state) | (loss, state, metrics)``: for a model made with
      ``eqx.nn.make_with_state`` (split with ``eqx_split(model, state)``).

    The model is in training mode (``eqx.nn.inference_mode(model, False)``: dropout on, BatchNorm on batch
    statistics) whatever mode it was split in. ``key`` differs at every step; split it between layers that draw,
    and per example with ``jax.random.split(key, rows)`` (each example then draws as on one device:
    ``DataParallel(rng=...)``).

    Raises:
      TypeError: here, for an ``fn`` of any other shape (``*args``, 2 or 5 parameters, no signature); at the first
        step, for a 3-parameter ``fn`` given a model with ``eqx.nn.State``, or a return of another shape.
    """
    import equinox as eqx

    with_state = _eqx_takes_state(fn)

    def loss_fn(params, model_state, batch, rng):
        model = eqx.nn.inference_mode(eqx.combine(params, static), False)
        if with_state:
            out = fn(model, model_state, batch, rng)
            if not isinstance(out, tuple) or len(out) not in (2, 3):
                raise TypeError(
                    "The function given to `eqx_loss`, fn(model, state, batch, key), must return (loss, state) or "
                    f"(loss, state, metrics), got {_shape_of(out)}."
                )
            loss, new_state, *metrics = out
            return loss, (new_state, metrics[0] if metrics else {})
        if jax.tree.leaves(model_state):
            raise TypeError(
                f"`eqx_loss` got fn(model, batch, key) ({_name(fn)}), but the model has an eqx.nn.State "
                f"(model_state: {len(jax.tree.leaves(model_state))} array(s)) that such a function cannot update. "
                "Take and return it: fn(model, state, batch, key) -> (loss, state) or (loss, state, metrics)."
            )
        out = fn(model, batch, rng)
        if isinstance(out, tuple) and len(out) != 2:
            raise TypeError(
                "The function given to `eqx_loss`, fn(model, batch, key), must return loss or (loss, metrics), got "
                f"{_shape_of(out)}."
            )
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        return loss, (model_state, metrics)

    return loss_fn


def _eqx_takes_state(fn: Callable[..., Any]) -> bool:
    """True for ``fn(model, state, batch, key)``, False for ``fn(model, batch, key)``: by the count of positional
    parameters; a TypeError for anything else."""
    import inspect

    forms = (
        "fn(model, batch, key) -> loss | (loss, metrics), or fn(model, state, batch, key) -> (loss, state[, metrics])"
    )
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise TypeError(
            f"`eqx_loss` needs a function whose parameters it can read, got {_name(fn)} (no signature). Pass a "
            f"Python function: {forms}."
        ) from None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_keywords = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    starred = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    if starred or required_keywords or len(positional) not in (3, 4):
        shown = ", ".join(str(p) for p in parameters)
        raise TypeError(
            f"`eqx_loss` reads the form of its function from its positional parameters, 3 or 4, but {_name(fn)}"
            f"({shown}) has {'*args' if starred else len(positional)}"
            f"{f' and the required keyword(s) {required_keywords}' if required_keywords else ''}. Write {forms}."
        )
    return len(positional) == 4


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _shape_of(out: Any) -> str:
    return f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__


def eqx_eval(static, fn: Callable[[Any, Any, jt.Batch], jt.Metrics]) -> jt.EvalFn:
    """A jddp ``eval_fn`` from ``fn(model, state, batch) -> dict of scalars``, the model in inference mode."""
    import equinox as eqx

    def eval_fn(params, model_state, batch):
        return fn(eqx.nn.inference_mode(eqx.combine(params, static), True), model_state, batch)

    return eval_fn


def eqx_module(static, state: state_lib.TrainState) -> tuple[Any, Any]:
    """The trained Equinox model and its ``eqx.nn.State`` on the host, in inference mode."""
    import equinox as eqx

    model = eqx.combine(to_host(state.params), static)
    return eqx.nn.inference_mode(model, True), to_host(state.model_state)
