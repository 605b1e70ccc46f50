"""The adapters of Equinox models (``pip install jddp[equinox]``): ``eqx_split``, ``eqx_loss``, ``eqx_eval``,
``eqx_module``. Equinox is imported when an adapter is called, so that jddp runs without it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jddp import typing as jt
from jddp.models import checks
from jddp.models import host as host_lib
from jddp.runtime import state as state_lib


def eqx_split(model, state=None) -> tuple[Any, jt.Params, Any]:
    """Splits an Equinox model into ``(static, params, model_state)``.

    ``params`` are the model's floating-point arrays (``eqx.partition(model,
    eqx.is_inexact_array)``), ``static`` everything else, and ``model_state`` is
    ``state``: the ``eqx.nn.State`` of ``eqx.nn.make_with_state`` (BatchNorm's
    statistics), or ``{}`` for a model without one.

    Raises:
      TypeError: ``model`` is not an ``eqx.Module`` (an NNX or Linen model is named as such), or ``state`` neither
        an ``eqx.nn.State`` nor None.
    """
    import equinox as eqx

    checks.check_of("eqx_split", "model", model, "eqx", eqx.Module, "an eqx.Module")
    if state is not None and not isinstance(state, eqx.nn.State):
        raise TypeError(
            f"`eqx_split`'s `state` must be the eqx.nn.State of eqx.nn.make_with_state, or None for a model without "
            f"one, got {checks.described(state)}."
        )
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

    checks.check_of("eqx_loss", "static", static, "eqx", eqx.Module, checks.STATIC_PART)
    checks.check_fn("eqx_loss", fn, "fn(model, batch, key) or fn(model, state, batch, key)")
    with_state = _eqx_takes_state(fn)

    def loss_fn(params, model_state, batch, rng):
        model = eqx.nn.inference_mode(eqx.combine(params, static), False)
        if with_state:
            out = fn(model, model_state, batch, rng)
            if not isinstance(out, tuple) or len(out) not in (2, 3):
                raise TypeError(
                    "The function given to `eqx_loss`, fn(model, state, batch, key), must return (loss, state) or "
                    f"(loss, state, metrics), got {checks.shape_of(out)}."
                )
            loss, new_state, *metrics = out
            return loss, (new_state, metrics[0] if metrics else {})
        if jax.tree.leaves(model_state):
            raise TypeError(
                f"`eqx_loss` got fn(model, batch, key) ({checks.name_of(fn)}), but the model has an eqx.nn.State "
                f"(model_state: {len(jax.tree.leaves(model_state))} array(s)) that such a function cannot update. "
                "Take and return it: fn(model, state, batch, key) -> (loss, state) or (loss, state, metrics)."
            )
        out = fn(model, batch, rng)
        if isinstance(out, tuple) and len(out) != 2:
            raise TypeError(
                "The function given to `eqx_loss`, fn(model, batch, key), must return loss or (loss, metrics), got "
                f"{checks.shape_of(out)}."
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
            f"`eqx_loss` needs a function whose parameters it can read, got {checks.name_of(fn)} (no signature). "
            f"Pass a Python function: {forms}."
        ) from None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_keywords = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    starred = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    if starred or required_keywords or len(positional) not in (3, 4):
        shown = ", ".join(str(p) for p in parameters)
        raise TypeError(
            "`eqx_loss` reads the form of its function from its positional parameters, 3 or 4, but "
            f"{checks.name_of(fn)}({shown}) has {'*args' if starred else len(positional)}"
            f"{f' and the required keyword(s) {required_keywords}' if required_keywords else ''}. Write {forms}."
        )
    return len(positional) == 4


def eqx_eval(static, fn: Callable[[Any, Any, jt.Batch], jt.Metrics]) -> jt.EvalFn:
    """A jddp ``eval_fn`` from ``fn(model, state, batch) -> dict of scalars``, the model in inference mode.

    Raises:
      TypeError: ``static`` is not an Equinox static part, or ``fn`` not a function.
    """
    import equinox as eqx

    checks.check_of("eqx_eval", "static", static, "eqx", eqx.Module, checks.STATIC_PART)
    checks.check_fn("eqx_eval", fn, "fn(model, state, batch) -> metrics")

    def eval_fn(params, model_state, batch):
        return fn(eqx.nn.inference_mode(eqx.combine(params, static), True), model_state, batch)

    return eval_fn


def eqx_module(static, state: state_lib.TrainState) -> tuple[Any, Any]:
    """The trained Equinox model and its ``eqx.nn.State`` on the host, in inference mode.

    Raises:
      TypeError: ``static`` is not an Equinox static part, or ``state`` not a live ``TrainState``.
      ValueError: ``state`` holds another model's parameters than ``static``'s.
    """
    import equinox as eqx

    checks.check_of("eqx_module", "static", static, "eqx", eqx.Module, checks.STATIC_PART)
    checks.check_train_state("eqx_module", state)
    try:
        model = eqx.combine(host_lib.to_host(state.params), static)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`eqx_module`'s `state` does not hold the model of `static`: eqx.combine could not join its params to "
            f"it ({checks.first_line(error)}). Pass the static part that eqx_split gave with the params of this state."
        ) from None
    return eqx.nn.inference_mode(model, True), host_lib.to_host(state.model_state)
