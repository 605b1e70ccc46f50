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

import sys
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jddp import typing as jt
from jddp import validate
from jddp.engine import reduce
from jddp.runtime import state as state_lib

# The three libraries the adapters take, and each one's adapters: an object of another library is refused naming
# the library given, the one expected and the adapters that take it.
LIBRARIES = {"nnx": "Flax NNX", "linen": "Flax Linen", "eqx": "Equinox"}
ADAPTERS = {
    "nnx": "nnx_split, nnx_loss, nnx_eval, nnx_module",
    "linen": "linen_split, linen_loss, linen_variables",
    "eqx": "eqx_split, eqx_loss, eqx_eval, eqx_module",
}
GRAPHDEF_PART = "the graphdef of jddp.models.nnx_split"
STATIC_PART = "the static part of jddp.models.eqx_split (an eqx.Module)"


def _library_of(value: Any) -> str | None:
    """``"nnx"``, ``"linen"`` or ``"eqx"`` for a model (or an NNX graphdef, an Equinox static part) of that library,
    else None. Equinox is only looked for when it is imported: an object of it cannot exist otherwise."""
    if isinstance(value, nnx.Module | nnx.GraphDef):
        return "nnx"
    if isinstance(value, nn.Module):
        return "linen"
    eqx = sys.modules.get("equinox")
    if eqx is not None and isinstance(value, eqx.Module):
        return "eqx"
    return None


def _described(value: Any) -> str:
    library = _library_of(value)
    if library is None:
        return f"{type(value).__name__} {value!r:.60}" if isinstance(value, str | int | float) else type(value).__name__
    article = "an" if LIBRARIES[library][0] in "AEIOU" else "a"
    return f"{article} {LIBRARIES[library]} object ({type(value).__name__})"


def _check_of(adapter: str, name: str, value: Any, library: str, kind: type, what: str) -> None:
    """A ``TypeError`` naming ``name`` unless ``value`` is a ``kind`` (``what``, an object of ``library``); an object
    of another of the three libraries is named as such, with the adapters that take it."""
    if isinstance(value, kind):
        return
    given = _library_of(value)
    given = library if given is None else given  # nothing to add for an object of no library
    other = f" {LIBRARIES[given]} models go through jddp.models.{ADAPTERS[given]}." if given != library else ""
    raise TypeError(
        f"`{adapter}` takes {LIBRARIES[library]} models: `{name}` must be {what}, got {_described(value)}.{other}"
    )


def _check_fn(adapter: str, fn: Any, form: str) -> None:
    """``fn`` is the user's function of ``form``: callable, and not a model (a model is callable too)."""
    if callable(fn) and _library_of(fn) is None:
        return
    raise TypeError(
        f"`{adapter}`'s `fn` must be your function {form}, got {_described(fn)}."
        + (" The model itself goes to the adapter that splits it." if _library_of(fn) is not None else "")
    )


def _check_train_state(adapter: str, state: Any) -> None:
    """``state`` is a live ``TrainState`` (its arrays on the devices, not donated): what ``dp.init`` or a step
    returned."""
    if not isinstance(state, state_lib.TrainState):
        raise TypeError(
            f"`{adapter}`'s `state` must be a jddp.TrainState (from dp.init or dp.step), got {_described(state)}."
        )
    if not isinstance(state.step, jax.Array):
        raise TypeError(
            f"`{adapter}`'s `state` must hold jax.Arrays, got state.step of type {type(state.step).__name__} (a host "
            "copy?). Pass the TrainState that dp.init or dp.step returned; it is copied to the host here."
        )
    if state.step.is_deleted():
        raise ValueError(
            f"`{adapter}`'s `state` was donated to a later step: its arrays are deleted. Pass the state the last "
            "step returned."
        )


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

    Raises:
      TypeError: ``model`` is not an ``nnx.Module`` (a Linen or Equinox model is named as such).
    """
    _check_of("nnx_split", "model", model, "nnx", nnx.Module, "an nnx.Module")
    graphdef, params, model_state = nnx.split(model, nnx.Param, ...)  # two filters: exactly two states
    model_state = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, model_state)
    return graphdef, params, model_state


def nnx_loss(graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, jt.Batch, Any], Any]) -> jt.LossFn:
    """A jddp ``loss_fn`` from ``fn(model, batch, rng) -> loss | (loss, metrics)``, the model in train mode and
    its ``nnx.Rngs`` streams drawn from ``rng`` (see the module docstring).

    Raises:
      TypeError: ``graphdef`` is not an NNX graphdef, or ``fn`` is not a function.
    """
    _check_of("nnx_loss", "graphdef", graphdef, "nnx", nnx.GraphDef, GRAPHDEF_PART)
    _check_fn("nnx_loss", fn, "fn(model, batch, rng) -> loss | (loss, metrics)")

    def loss_fn(params, model_state, batch, rng):
        model = nnx.merge(graphdef, params, _reseeded(model_state, rng), copy=True)
        model.train()
        loss, metrics = _loss_and_metrics(fn(model, batch, rng))
        _, _, new_model_state = nnx.split(model, nnx.Param, ...)
        return loss, (_streams_kept(new_model_state, model_state), metrics)

    return loss_fn


def nnx_eval(graphdef: nnx.GraphDef, fn: Callable[[nnx.Module, jt.Batch], jt.Metrics]) -> jt.EvalFn:
    """A jddp ``eval_fn`` from ``fn(model, batch) -> metrics``, with the model in eval mode.

    Raises:
      TypeError: ``graphdef`` is not an NNX graphdef, or ``fn`` is not a function.
    """
    _check_of("nnx_eval", "graphdef", graphdef, "nnx", nnx.GraphDef, GRAPHDEF_PART)
    _check_fn("nnx_eval", fn, "fn(model, batch) -> metrics")

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
    _check_of("nnx_module", "graphdef", graphdef, "nnx", nnx.GraphDef, GRAPHDEF_PART)
    _check_train_state("nnx_module", state)
    try:
        model = nnx.merge(graphdef, to_host(state.params), _typed_keys(to_host(state.model_state)))
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`nnx_module`'s `state` does not hold the model of `graphdef`: nnx.merge could not put its params and "
            f"model_state into it ({_first_line(error)}). Pass the graphdef that nnx_split gave with the params of "
            "this state."
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


def linen_variables(state: state_lib.TrainState) -> dict:
    """The Linen variables of ``state`` on the host: ``module.apply(linen_variables(state), x, train=False)``.

    Raises:
      TypeError: ``state`` is not a live ``TrainState``.
    """
    _check_train_state("linen_variables", state)
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
    """Splits Linen ``variables`` into ``(params, model_state)``.

    Raises:
      TypeError: ``variables`` is not a mapping with ``"params"`` (what ``module.init`` returns).
    """
    _check_of("linen_split", "variables", variables, "linen", Mapping, "the variables of module.init (a mapping)")
    if "params" not in variables:
        raise TypeError(
            "`linen_split`'s `variables` must hold the collection 'params' (the variables of module.init), got a "
            f"mapping with the keys {sorted(map(str, variables))}."
        )
    variables = dict(variables)
    return variables.pop("params"), variables


def linen_loss(module, fn: Callable[[Callable, jt.Batch, Any], Any], *, rng_name: str = "dropout") -> jt.LossFn:
    """A jddp ``loss_fn`` from ``fn(apply, batch, rng) -> loss | (loss, metrics)``.

    Raises:
      TypeError: ``module`` is not a Linen module, ``fn`` not a function or ``rng_name`` not a str.
    """
    _check_of("linen_loss", "module", module, "linen", nn.Module, "a flax.linen.Module")
    _check_fn("linen_loss", fn, "fn(apply, batch, rng) -> loss | (loss, metrics)")
    validate.check_str("rng_name", rng_name)

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

    Raises:
      TypeError: ``model`` is not an ``eqx.Module`` (an NNX or Linen model is named as such), or ``state`` neither
        an ``eqx.nn.State`` nor None.
    """
    import equinox as eqx

    _check_of("eqx_split", "model", model, "eqx", eqx.Module, "an eqx.Module")
    if state is not None and not isinstance(state, eqx.nn.State):
        raise TypeError(
            f"`eqx_split`'s `state` must be the eqx.nn.State of eqx.nn.make_with_state, or None for a model without "
            f"one, got {_described(state)}."
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

    _check_of("eqx_loss", "static", static, "eqx", eqx.Module, STATIC_PART)
    _check_fn("eqx_loss", fn, "fn(model, batch, key) or fn(model, state, batch, key)")
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


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _shape_of(out: Any) -> str:
    return f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__


def eqx_eval(static, fn: Callable[[Any, Any, jt.Batch], jt.Metrics]) -> jt.EvalFn:
    """A jddp ``eval_fn`` from ``fn(model, state, batch) -> dict of scalars``, the model in inference mode.

    Raises:
      TypeError: ``static`` is not an Equinox static part, or ``fn`` not a function.
    """
    import equinox as eqx

    _check_of("eqx_eval", "static", static, "eqx", eqx.Module, STATIC_PART)
    _check_fn("eqx_eval", fn, "fn(model, state, batch) -> metrics")

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

    _check_of("eqx_module", "static", static, "eqx", eqx.Module, STATIC_PART)
    _check_train_state("eqx_module", state)
    try:
        model = eqx.combine(to_host(state.params), static)
    except (ValueError, TypeError) as error:
        raise ValueError(
            "`eqx_module`'s `state` does not hold the model of `static`: eqx.combine could not join its params to "
            f"it ({_first_line(error)}). Pass the static part that eqx_split gave with the params of this state."
        ) from None
    return eqx.nn.inference_mode(model, True), to_host(state.model_state)
