"""What jddp's model adapters accept, and how they say what they refuse: which library an object is of, checks of
models, functions and ``TrainState`` arguments, and the shape of what a user's loss function returned."""

from __future__ import annotations

import sys
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

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


def library_of(value: Any) -> str | None:
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


def described(value: Any) -> str:
    library = library_of(value)
    if library is None:
        return f"{type(value).__name__} {value!r:.60}" if isinstance(value, str | int | float) else type(value).__name__
    article = "an" if LIBRARIES[library][0] in "AEIOU" else "a"
    return f"{article} {LIBRARIES[library]} object ({type(value).__name__})"


def check_of(adapter: str, name: str, value: Any, library: str, kind: type, what: str) -> None:
    """A ``TypeError`` naming ``name`` unless ``value`` is a ``kind`` (``what``, an object of ``library``); an object
    of another of the three libraries is named as such, with the adapters that take it."""
    if isinstance(value, kind):
        return
    given = library_of(value)
    given = library if given is None else given  # nothing to add for an object of no library
    other = f" {LIBRARIES[given]} models go through jddp.models.{ADAPTERS[given]}." if given != library else ""
    raise TypeError(
        f"`{adapter}` takes {LIBRARIES[library]} models: `{name}` must be {what}, got {described(value)}.{other}"
    )


def check_fn(adapter: str, fn: Any, form: str) -> None:
    """``fn`` is the user's function of ``form``: callable, and not a model (a model is callable too)."""
    if callable(fn) and library_of(fn) is None:
        return
    raise TypeError(
        f"`{adapter}`'s `fn` must be your function {form}, got {described(fn)}."
        + (" The model itself goes to the adapter that splits it." if library_of(fn) is not None else "")
    )


def check_train_state(adapter: str, state: Any) -> None:
    """``state`` is a live ``TrainState`` (its arrays on the devices, not donated): what ``dp.init`` or a step
    returned."""
    if not isinstance(state, state_lib.TrainState):
        raise TypeError(
            f"`{adapter}`'s `state` must be a jddp.TrainState (from dp.init or dp.step), got {described(state)}."
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


def loss_and_metrics(out) -> tuple[Any, dict]:
    if isinstance(out, tuple) and not isinstance(out, reduce.Weighted) and len(out) == 2:
        loss, metrics = out
        if not isinstance(metrics, dict):
            raise TypeError(f"The loss function's metrics must be a dict, got {type(metrics).__name__}.")
        return loss, metrics
    return out, {}


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def shape_of(out: Any) -> str:
    return f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__
