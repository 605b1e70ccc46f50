"""Which values of a device program differ across the data axis, found from the program's jaxpr.

jddp runs the user's loss inside ``shard_map`` with ``check_vma=False``: the
classic (``pmap``) semantics, in which a value carries no type saying whether it
varies over ``"data"``. That is what lets any function that runs under plain
``jax.jit`` run unchanged in the step. Under ``check_vma=True`` a
``lax.scan``, ``while_loop`` or ``fori_loop`` whose carry starts from a constant
(``jnp.zeros``) and is updated from the batch, or a ``lax.cond`` with a
constant branch, is refused ("carry input and carry output must have equal
types"), which rules out RNNs, ``nnx.scan`` and ``nn.scan`` layer stacks,
iterative solvers and sampling loops, unless the user annotates their model
with jddp's axis. It also makes ``jax.grad`` differentiate a replicated
parameter through an implicit ``psum`` (the gradient trap); with
``check_vma=False`` the gradient is the device's own, and the engine sums it
once, explicitly.

The engine still needs to know which model-state leaves differ across devices
(batch statistics computed from the device's slice, to be averaged) and which
are the same everywhere (a step counter, an RNG stream's count, statistics the
model already synchronised with ``lax.pmean``: left alone, bit for bit).
``traced`` finds it from the jaxpr: a value varies when it depends on the
batch or on ``lax.axis_index`` over ``"data"``, except through a collective
that makes it the same on every device (``psum``, ``pmean``, ``pmax``,
``pmin``, ``all_gather``); a collective that hands each device its own part
(``psum_scatter``, ``all_to_all``, ``ppermute``) makes it vary. Loops are followed to their fixed point, a ``cond``
or ``while`` whose predicate varies makes all its results vary, and a
primitive this analysis does not know makes its results vary when any input
does (the safe side: a value wrongly called varying is averaged, which costs a
few bytes of the all-reduce and float round-off, never a divergence).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp

from jddp import runtime
from jddp.runtime import jax_internals

DATA = runtime.DATA_AXIS

# Collectives whose result is the same on every device of the axes they reduce over.
_REDUCING = frozenset({"psum", "pmax", "pmin", "all_gather", "psum_invariant", "all_gather_invariant"})
# Collectives that hand each device its own part (different values even from identical inputs).
_SPLITTING = frozenset({"reduce_scatter", "all_to_all", "ppermute", "psum_scatter", "pshuffle"})
# Calls whose sub-jaxpr takes exactly the equation's inputs and gives its outputs.
_CALL_PARAMS = ("jaxpr", "call_jaxpr")
# An axis name no program uses: with it, ``varying_outputs`` tells which outputs depend on the inputs at all.
_NO_AXIS = "jddp: no axis"


def traced(fn: Callable, args: tuple, varying_args: tuple[bool, ...], axis: str = DATA, *, inputs: bool = False):
    """``fn(*args)`` traced once, and which leaves of its result vary over ``axis``.

    Args:
      fn: a function of ``args``, called inside ``shard_map`` over ``axis``.
      args: its arguments (pytrees of arrays or tracers).
      varying_args: for each argument, whether all its leaves vary over ``axis`` (the batch) or none do (the
        replicated state).
      axis: the mesh axis.
      inputs: also return which leaves of the result depend on any argument at all (False: a constant of the
        program, such as the zero gradient of a loss that does not read the parameters).

    Returns:
      ``(result, flags)``: ``fn``'s result, and a pytree of its structure holding True for each leaf that may
      differ across devices; with ``inputs``, ``(result, flags, depends)``.
    """
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    flat_args = jax.tree.leaves(args)
    in_flags = [v for a, v in zip(args, varying_args, strict=True) for _ in jax.tree.leaves(a)]
    out_flags = varying_outputs(closed, in_flags, axis)
    outs = jex.core.jaxpr_as_fun(closed)(*flat_args)
    treedef = jax.tree.structure(shapes)
    result, flags = jax.tree.unflatten(treedef, list(outs)), jax.tree.unflatten(treedef, out_flags)
    if not inputs:
        return result, flags
    # Dependence on any input: the same walk with every input marked and an axis no collective names.
    depends = varying_outputs(closed, [True] * len(flat_args), _NO_AXIS)
    return result, flags, jax.tree.unflatten(treedef, depends)


def varying_outputs(closed, in_flags: Sequence[bool], axis: str) -> list[bool]:
    """For each output of the closed jaxpr, whether it may differ across ``axis`` given which inputs do."""
    return _jaxpr(closed.jaxpr, [False] * len(closed.consts), list(in_flags), axis)


def _jaxpr(jaxpr, const_flags: list[bool], in_flags: list[bool], axis: str) -> list[bool]:
    env: dict = {}
    for var, flag in zip(jaxpr.constvars, const_flags, strict=True):
        env[var] = flag
    for var, flag in zip(jaxpr.invars, in_flags, strict=True):
        env[var] = flag

    def read(atom) -> bool:
        return False if isinstance(atom, jex.core.Literal) else env[atom]

    for eqn in jaxpr.eqns:
        outs = _equation(eqn, [read(a) for a in eqn.invars], axis)
        for var, flag in zip(eqn.outvars, outs, strict=True):
            env[var] = flag
    return [read(a) for a in jaxpr.outvars]


def _names(value) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _equation(eqn, ins: list[bool], axis: str) -> list[bool]:
    name, params, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
    if name == "axis_index":
        return [axis in _names(params["axis_name"])] * n_out
    if name in _REDUCING:
        axes = _names(params.get("axes", params.get("axis_name", ())))
        return [False if axis in axes else any(ins)] * n_out
    if name in _SPLITTING:
        axes = _names(params.get("axis_name", params.get("axes", ())))
        return [axis in axes or any(ins)] * n_out
    if name == "cond":
        if ins[0]:  # devices may take different branches
            return [True] * n_out
        per_branch = [_closed(b, ins[1:], axis) for b in params["branches"]]
        return [any(flags) for flags in zip(*per_branch, strict=True)]
    if name == "scan":
        return _scan(params, ins, axis)
    if name == "while":
        return _while(params, ins, axis)
    for key in _CALL_PARAMS:
        sub = params.get(key)
        if sub is not None and len(_inner(sub).invars) == len(ins) and len(_inner(sub).outvars) == n_out:
            return _closed(sub, ins, axis)
    return [any(ins)] * n_out


def _inner(sub):
    return sub.jaxpr if isinstance(sub, jex.core.ClosedJaxpr) else sub


def _closed(sub, ins: list[bool], axis: str) -> list[bool]:
    consts = len(sub.consts) if isinstance(sub, jex.core.ClosedJaxpr) else len(sub.constvars)
    return _jaxpr(_inner(sub), [False] * consts, ins, axis)


def _scan(params, ins: list[bool], axis: str) -> list[bool]:
    n_consts, n_carry = jax_internals.scan_counts(params)  # jax 0.11 moved them into a FlatTree
    consts, carry, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]
    while True:  # the carry's flags only grow: at most n_carry + 1 rounds
        outs = _closed(params["jaxpr"], consts + carry + xs, axis)
        grown = [c or o for c, o in zip(carry, outs[:n_carry], strict=True)]
        if grown == carry:
            return carry + outs[n_carry:]
        carry = grown


def _while(params, ins: list[bool], axis: str) -> list[bool]:
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    cond_consts, body_consts, carry = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
    while True:
        if _closed(params["cond_jaxpr"], cond_consts + carry, axis)[0]:  # trip counts may differ
            return [True] * len(carry)
        grown = [c or o for c, o in zip(carry, _closed(params["body_jaxpr"], body_consts + carry, axis), strict=True)]
        if grown == carry:
            return carry
        carry = grown


def split_varying(tree, flags):
    """Splits a pytree's leaves into (all leaves, the varying float leaves to average, rebuild).

    ``flags`` is a pytree of ``tree``'s structure (from ``traced``): True where a leaf may differ across devices.
    A varying leaf that is not a float cannot be averaged and is refused by name.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in with_paths]
    idx = []
    for i, ((path, x), flag) in enumerate(zip(with_paths, jax.tree.leaves(flags), strict=True)):
        if not flag:
            continue
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise ValueError(
                f"Model state leaf model_state{jax.tree_util.keystr(path)} (dtype={x.dtype}) differs across devices "
                "and is not a float, so it cannot be averaged; compute it from replicated values."
            )
        idx.append(i)

    def rebuild(all_leaves, averaged):
        out = list(all_leaves)
        for i, x in zip(idx, averaged, strict=True):
            out[i] = x.astype(all_leaves[i].dtype)
        return jax.tree.unflatten(treedef, out)

    return leaves, [leaves[i] for i in idx], rebuild
