"""The training state: a pytree of arrays only, and the checks of arrays and states every layer shares."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from jddp import typing as jt
from jddp.runtime.layout import LeafLayout

# What a leaf of a state may be: a device or host array, a NumPy scalar, or the shape of one (an abstract state for
# ``jax.eval_shape`` or a restore target). Tracers are jax.Arrays.
ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)

MSG_DONATED = (
    "`{name}` was donated to an earlier step (or deleted): `DataParallel.step` reuses its input state's memory for "
    "the new state (donate=True), so an old state and its arrays cannot be used again. Use the state that `step` "
    "returned (`state, metrics = dp.step(state, batch)`), or build DataParallel with donate=False to keep old states."
)


def is_deleted(x: Any) -> bool:
    """Whether ``x`` is a concrete ``jax.Array`` whose buffers are gone (donated or deleted)."""
    return isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted()


def holds_equinox_module(tree: Any) -> bool:
    """Whether ``tree`` is or holds an Equinox module, whose Python numbers are static (``eqx.filter_jit``'s rule: a
    ``hidden_size`` in a shape) where ``jax.jit`` traces them: ``jddp.data_parallel`` and a checkpoint of any pytree
    (``jddp.checkpoint.any_tree``) follow the one rule or the other."""
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return False
    return any(isinstance(x, eqx.Module) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, eqx.Module)))


def check_array(name: str, x: Any, *, real: bool = True) -> None:
    """Raises unless ``x`` is an array (jax, NumPy, a NumPy scalar, a tracer) that is still alive and, if ``real``,
    holds real numbers or bools: ``TypeError`` naming ``name`` for anything else (a list, a string, strings),
    ``ValueError`` for a donated or deleted ``jax.Array``."""
    if not isinstance(x, ARRAY_TYPES):
        raise TypeError(
            f"`{name}` must be an array (jax.Array or np.ndarray), got {type(x).__name__} ({_shown(x)}). Convert it "
            "with `jnp.asarray`."
        )
    if is_deleted(x):
        raise ValueError(MSG_DONATED.format(name=name))
    # jnp.issubdtype knows the ml_dtypes floats (bfloat16, float8): NumPy sees them as kind "V"
    number = not _is_key(x) and any(jnp.issubdtype(x.dtype, t) for t in (jnp.floating, jnp.integer, jnp.bool_))
    if real and not number:
        raise TypeError(f"`{name}` must hold real numbers or bools, got dtype={x.dtype}.")


def check_tree(name: str, tree: Any, *, device: bool = False, empty: bool = True) -> list:
    """The leaves of ``tree`` after checking that each is an array (``ARRAY_TYPES``; only live jax.Arrays
    if ``device``), naming the first leaf that is not, and, unless ``empty``, that there is one."""
    leaves_with_paths = jax.tree.leaves_with_path(tree)
    kinds = jax.Array if device else ARRAY_TYPES
    for path, x in leaves_with_paths:
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not isinstance(x, kinds):
            what = "a jax.Array on the devices" if device else "an array (jax.Array or np.ndarray)"
            raise TypeError(
                f"Every leaf of `{name}` must be {what}, but {where} is {type(x).__name__} ({_shown(x)})."
                + (" Put it on the devices with `jax.device_put`." if device else "")
            )
        if is_deleted(x):
            raise ValueError(MSG_DONATED.format(name=name) + f" ({where} is deleted)")
    if not empty and not leaves_with_paths:
        raise ValueError(f"`{name}` holds no arrays, got {name}={_shown(tree)}; pass a pytree of arrays.")
    return [x for _, x in leaves_with_paths]


def check_state(name: str, state: Any) -> None:
    """Raises unless ``state`` is a ``TrainState`` whose step counter is a live ``jax.Array`` (not a host copy,
    not donated to an earlier step). One attribute read and one call: cheap enough for every step."""
    if not isinstance(state, TrainState):
        raise TypeError(
            f"`{name}` must be a jddp.TrainState from `init`, got {type(state).__name__}. Pass the state that "
            "`DataParallel.init` or `step` returned."
        )
    step = state.step
    if not isinstance(step, jax.Array):
        raise TypeError(
            f"`{name}` must hold jax.Arrays on the devices, got a state whose step is {type(step).__name__} (a host "
            "copy). Pass the TrainState from `init` or `step`, or restore the checkpoint onto the mesh."
        )
    # The step counter is donated with the rest of the state (``DataParallel.step`` marks a state whose counter JAX
    # could not donate, see ``mark_donated``): checking it alone is enough, without flattening the state.
    if step.is_deleted():
        raise ValueError(MSG_DONATED.format(name=name))


def mark_donated(state: TrainState) -> None:
    """Makes ``state``, just donated to a program, read as donated if its step counter survived the donation.

    JAX cannot donate a buffer that a NumPy view references (``np.asarray(x)``, ``jax.device_get(x)``: zero-copy on
    CPU; ``jddp.Checkpointer`` pins the buffers it is writing so): the program then runs on a copy of that buffer,
    donates the other devices' copies of the array, and ``x.is_deleted()`` stays False. Stepping such a state again
    executed a donated buffer (XLA: "Buffer has been deleted or donated", then a segmentation fault). Its step
    counter is replaced by a deleted array of the same shape, dtype and sharding: ``check_state`` refuses the state
    naming it, and so does any check of its leaves (``is_deleted``), while the pinned buffers stay readable to
    whoever pinned them (deleting the arrays themselves would delete them). One call when nothing survived."""
    step = state.step
    if step.is_deleted():
        return
    zeros = np.zeros(step.shape, step.dtype)
    gone = jax.make_array_from_callback(step.shape, step.sharding, lambda index: zeros[index])  # local: no collective
    gone.delete()
    object.__setattr__(state, "step", gone)  # the frozen dataclass's own way of setting a field


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that changes during training, replicated over the mesh.

    A state built by hand (``TrainState(...)``, ``state.replace(...)``) is checked when made: ``step`` an integer
    scalar, ``rng`` ``uint32[2]``, the trees' leaves arrays, none donated; ``TypeError``/``ValueError`` naming the
    field otherwise. JAX's tree functions rebuild states without the checks (their leaves may be anything).

    Attributes:
      step: int32 scalar, the number of steps taken (skipped ones included).
      params: the trainable parameters.
      opt_state: the optax optimizer state.
      model_state: non-trainable model variables (for example BatchNorm
        statistics); ``{}`` when the model has none.
      rng: ``uint32[2]`` raw key data (``jax.random.key_data``) of the base key;
        step ``s`` on device ``d`` uses ``fold_in(fold_in(key, s), d)``.
      opt_layout: not a leaf: ``None`` when ``opt_state`` is replicated; with
        ``DataParallel(shard_optimizer=True)``, one ``jddp.runtime.layout.LeafLayout``
        per leaf of ``opt_state`` (its logical shape, the dimension split over
        ``"data"`` and that dimension's padding), so that a checkpoint records
        logical shapes and restores onto other device counts.
    """

    step: jax.Array
    params: jt.Params
    opt_state: jt.PyTree
    model_state: jt.ModelState
    rng: jax.Array
    opt_layout: tuple[LeafLayout, ...] | None = None

    def __post_init__(self):
        if isinstance(self.step, Tracer):
            return  # inside a traced program (jddp's own builds states from its arguments): values are abstract
        _check_scalar("step", self.step, shape=(), kinds="iu", what="an integer scalar (int32)")
        check_tree("params", self.params, empty=False)
        for name in ("opt_state", "model_state"):
            value = getattr(self, name)
            if value is None:
                fix = "optax's `optimizer.init(params)`" if name == "opt_state" else "`{}` when the model has none"
                raise TypeError(f"`{name}` must be a pytree of arrays ({fix}), got {name}=None.")
            check_tree(name, value)
        _check_scalar("rng", self.rng, shape=(2,), kinds="u", what="uint32[2] key data (`jax.random.key_data(key)`)")
        layout = self.opt_layout
        if layout is not None and not (isinstance(layout, tuple) and all(isinstance(x, LeafLayout) for x in layout)):
            raise TypeError(
                f"`opt_layout` must be None or a tuple of jddp.runtime.layout.LeafLayout (kept by `state.replace`), "
                f"got {_shown(layout)}."
            )

    def replace(self, **changes) -> TrainState:
        """A copy with ``changes`` applied (``dataclasses.replace``), checked as a new state is."""
        return dataclasses.replace(self, **changes)


def unchecked_state(step, params, opt_state, model_state, rng, opt_layout=None) -> TrainState:
    """A ``TrainState`` of values known to be right (a program's outputs, JAX's tree functions): no checks."""
    state = object.__new__(TrainState)
    state.__dict__.update(  # what the frozen dataclass's __init__ sets, without __post_init__ (once per step)
        step=step, params=params, opt_state=opt_state, model_state=model_state, rng=rng, opt_layout=opt_layout
    )
    return state


_KEYS = tuple(jax.tree_util.GetAttrKey(name) for name in ("step", "params", "opt_state", "model_state", "rng"))


def _check_scalar(name: str, x: Any, *, shape: tuple, kinds: str, what: str) -> None:
    if not isinstance(x, ARRAY_TYPES) or _is_key(x):
        raise TypeError(f"`{name}` must be {what}, got {type(x).__name__} ({_shown(x)}).")
    if is_deleted(x):
        raise ValueError(MSG_DONATED.format(name=name))
    if tuple(x.shape) != shape or np.dtype(x.dtype).kind not in kinds or (name == "rng" and x.dtype != np.uint32):
        raise ValueError(f"`{name}` must be {what}, got shape={tuple(x.shape)}, dtype={x.dtype}.")


def _is_key(x: Any) -> bool:
    return jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _shown(value: Any) -> str:
    try:
        return f"{value!r:.60}"
    except Exception:  # a deleted jax.Array cannot show its values
        return f"<{type(value).__name__}>"


# Registered with keys (``.step``, ``.params``, ...: the paths ``register_dataclass`` gave) and an unflatten that
# skips ``__post_init__``: JAX rebuilds states with whatever leaves a tree function returns.
jax.tree_util.register_pytree_with_keys(
    TrainState,
    lambda s: (tuple(zip(_KEYS, (s.step, s.params, s.opt_state, s.model_state, s.rng), strict=True)), s.opt_layout),
    lambda layout, children: unchecked_state(*children, opt_layout=layout),
    lambda s: ((s.step, s.params, s.opt_state, s.model_state, s.rng), s.opt_layout),
)
