"""What a standby process compiles before it stands by: the step of a hand-written loop, as ``jddp.fit`` does.

A standby process (``jddp.runtime.standby``) is the next attempt's, started before the failure; what it compiles
before it stands by, its restart does not. ``jddp.fit`` compiles its step there; a loop of the script's own
(``state = ckpt.restore_or_init(dp.init(...))``, then ``dp.step`` over the loader) gets the same from two hooks
registered where the engine learns what the restart will call it with:

* ``DataParallel.init`` (``remember``): the step, for the state ``init`` built (a restore keeps its shapes,
  dtypes and shardings) and a batch of the training loader; and, when the engine has an ``eval_fn`` (the script
  defined an evaluation), the evaluation program for a batch of each other loader. Without ``eval_fn`` nothing says
  the script evaluates: ``eval_step`` compiles at its first call, after the wake.
* ``jddp.data_parallel`` (``remember_step``): the script's step, where its arguments can be known ahead: a step
  of one state argument and one batch argument (``train_step(state, batch)``), called with the state given to the
  restore (``standby.restoring``, what it restores has its shapes) and a batch of the training loader. A step of
  more arguments (``make_step(model, x, y, opt_state)``), a batch that the script takes apart, or a restore that
  never names its state: unknown ahead, so the step compiles at its first call, after the wake, as before.

A state the script dropped or donated before the restore is not the restore's: nothing is compiled for it. Only
tracing and compiling happen: no program runs, no state is touched, nothing is written. An error while compiling
ends the standby process (``jddp.runtime.standby``: the restart starts the process anew).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any

import jax
import numpy as np

from jddp.engine import checks
from jddp.runtime import standby
from jddp.runtime import state as state_lib

_ARRAYS = (jax.Array, np.ndarray, np.generic)


def remember(dp: Any, state: state_lib.TrainState) -> None:
    """In a standby process: ``dp``'s (a ``DataParallel``) step compiled for ``state`` and the training loader's
    batch before it stands by (its evaluation program too, with an ``eval_fn``). Elsewhere nothing."""
    if standby.active():
        standby.before_standing_by(functools.partial(_compile_engine, weakref.ref(dp), weakref.ref(state)))


def remember_step(step: Any) -> None:
    """In a standby process: ``step`` (a ``DataParallelStep``) compiled before it stands by, where its arguments
    can be known ahead (the module docstring says when). Elsewhere nothing."""
    if standby.active():
        standby.before_standing_by(functools.partial(_compile_step, weakref.ref(step)))


def _deleted(tree: Any) -> bool:
    return any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree))


def _compile_engine(dp_ref: weakref.ref, state_ref: weakref.ref) -> None:
    dp, state = dp_ref(), state_ref()
    if dp is None or state is None or _deleted(state):
        return  # not what the restore starts from
    batch = standby.batch_ahead()
    if batch is None:
        return
    dp.compile(state, batch)
    if dp.eval_fn is None:
        return
    for other in standby.other_batches_ahead():
        checks.check_call(dp, state, other, "batch", accumulated=False)
        dp._programs.eval.lower(*dp._eval_args(state, other)).compile()


def _compile_step(step_ref: weakref.ref) -> None:
    step, state = step_ref(), standby.restoring_state()
    if step is None or state is None or _deleted(state) or len(step.batch_argnums) != 1:
        return
    if _positional_arity(step.fn) != 2 or step.batch_argnums[0] > 1:
        return  # more arguments than a state and a batch: what they will be is not known ahead
    batch = standby.batch_ahead()
    if batch is None:
        return
    args = [None, None]
    args[step.batch_argnums[0]] = batch
    args[1 - step.batch_argnums[0]] = _restored_shapes(state, step._rep)
    call = step._split(tuple(args), place=False)
    step._program(call).jitted.lower(call.donated, call.kept, call.batch).compile()


def _restored_shapes(tree: Any, sharding: jax.sharding.Sharding) -> Any:
    """``tree`` as a restore gives it back (``jddp.checkpoint.any_tree``), as shapes: each array (and, outside an
    Equinox module, each Python number) a ``jax.ShapeDtypeStruct`` of its canonical dtype held whole on every
    device; other leaves as they are."""
    numbers = not state_lib.holds_equinox_module(tree)

    def shaped(x):
        if isinstance(x, _ARRAYS) or (numbers and isinstance(x, (bool, int, float))):
            x = x if isinstance(x, jax.Array) else np.asarray(x)
            return jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype), sharding=sharding)
        return x

    return jax.tree.map(shaped, tree)


def _positional_arity(fn: Any) -> int | None:
    """The positional parameters ``fn`` requires, or None when it takes ``*args`` or has no signature."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds and p.default is p.empty for p in parameters)
