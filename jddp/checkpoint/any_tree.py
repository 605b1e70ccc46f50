"""Any pytree as a checkpoint's state: the state of a script that owns its train step (a Flax ``TrainState``, an
Equinox model and its optimizer state, a tuple) saved and restored by the same ``Checkpointer`` as jddp's own.

The tree travels inside a ``jddp.TrainState``: its array leaves, keyed by their paths (``['params']['Dense_0']
['kernel']``, so that a checkpoint of another model names the leaf that differs), are the state's ``params``; its
step is ``step=`` or the tree's own ``step`` attribute (Flax's ``TrainState.step``). A Python number is saved as an
array, as ``jax.jit`` traces it, except in a tree holding an Equinox module (static there, as ``eqx.filter_jit``
makes it); the other leaves that are not arrays (an Equinox module's activation, Flax's ``apply_fn``) are not saved
and come back from the tree the restore is given, as ``eqx.filter``/``eqx.combine`` would. Arrays that are not yet
laid out over the devices (a state fresh from ``init``, on one device) are placed whole on every device of
``jddp.data_mesh()`` first, as ``jddp.data_parallel`` places them at its first call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jddp import runtime
from jddp.runtime import state as state_lib

_ARRAYS = (jax.Array, np.ndarray, np.generic)


def is_foreign(state: Any) -> bool:
    """Whether ``state`` is a tree of the user's own, not a ``jddp.TrainState``."""
    return not isinstance(state, state_lib.TrainState)


def wrapped(tree: Any, step: int | None, what: str) -> tuple[state_lib.TrainState, Callable[[Any], Any]]:
    """``tree`` as a ``TrainState`` at ``step``, and the function that turns a restored ``TrainState`` back into a
    tree of ``tree``'s structure (its non-array leaves ``tree``'s own).

    Raises:
      TypeError: a tree without arrays, or without a step (no ``step=`` and no integer ``tree.step``), naming
        ``what`` (the method) and the fix.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not state_lib.holds_equinox_module(tree):  # a Python number is state, as jax.jit and data_parallel trace it
        leaves = [(p, np.asarray(x) if isinstance(x, (bool, int, float)) else x) for p, x in leaves]
    arrays = {jax.tree_util.keystr(p) or "(the state)": x for p, x in leaves if isinstance(x, _ARRAYS)}
    if not arrays:
        raise TypeError(
            f"`state` of {what} holds no arrays, got {type(tree).__name__}: pass the training state (a "
            "jddp.TrainState, or a pytree of arrays such as Flax's TrainState or an (model, opt_state) tuple)."
        )
    counter = _step_of(tree, step, what)
    placed = _placed(arrays)
    sharding = NamedSharding(_mesh_of(placed), P())
    if isinstance(counter, jax.Array) and _on_mesh(counter) and counter.dtype == np.int32:
        placed_step = counter  # Flax's step after a data_parallel step: as it is, on the devices
    else:
        placed_step = _put(np.asarray(jax.device_get(counter), np.int32), sharding)
    state = state_lib.TrainState(
        step=placed_step,
        params=placed,
        opt_state={},
        model_state={},
        rng=_put(np.zeros(2, np.uint32), sharding),
    )

    def unwrap(restored: state_lib.TrainState):
        by_path = restored.params
        out = [by_path[jax.tree_util.keystr(p) or "(the state)"] if isinstance(x, _ARRAYS) else x for p, x in leaves]
        return jax.tree.unflatten(treedef, out)

    return state, unwrap


def _step_of(tree: Any, step: int | None, what: str):
    """``step``, else the tree's own integer ``step`` (an int or an integer scalar array, left on its devices)."""
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise TypeError(f"`step` must be a non-negative int, got step={step!r}.")
        return int(step)
    own = getattr(tree, "step", None)
    if isinstance(own, (int, np.integer)) and not isinstance(own, bool):
        return int(own)
    if isinstance(own, _ARRAYS) and np.ndim(own) == 0 and np.issubdtype(own.dtype, np.integer):
        return own
    raise TypeError(
        f"{what} needs the step of a {type(tree).__name__} state: pass `step=` (the number of steps taken), or "
        "keep it in the state as an integer `state.step` (Flax's TrainState does)."
    )


def _placed(arrays: dict[str, Any]) -> dict[str, Any]:
    """Each array as it is when it is laid out over a mesh already, else held whole on every device of
    ``jddp.data_mesh()`` (from this process's value: every process holds the same fresh state)."""
    first_mesh = next((x.sharding.mesh for x in arrays.values() if _on_mesh(x)), None)
    sharding = NamedSharding(first_mesh if first_mesh is not None else runtime.data_mesh(), P())
    return {k: x if _on_mesh(x) else _put(np.asarray(jax.device_get(x)), sharding) for k, x in arrays.items()}


def _on_mesh(x: Any) -> bool:
    return isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)


def _mesh_of(arrays: dict[str, Any]):
    return next(x.sharding.mesh for x in arrays.values())


def _put(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``host`` whole on every device of ``sharding``; every device its own copy (no aliasing, donation safe)."""
    return jax.make_array_from_callback(host.shape, sharding, lambda index: np.array(host[index], copy=True))
