"""Random draws that depend on an example's place in the global batch, not on the device that holds it.

A model draws its dropout masks, noise or augmentations with shapes that
follow the batch it is given: ``jax.random.bernoulli(key, p, x.shape)`` with
``x`` of ``[rows, ...]``. On one device ``rows`` is the global batch; on ``N``
devices each device sees ``rows / N`` of it. With one key per device (the
classic recipe: ``fold_in(key, axis_index)``), the example at global row ``g``
gets other random numbers on every device layout, so runs on 1, 8 or 2 x 4
devices differ from the first step and a resume onto another device count is
not the same run.

``per_example(fn, rows, total)`` runs ``fn`` so that every draw whose leading
axis is the batch's (``rows`` long, from a key that is not itself batched) is
made for the whole global batch (``total`` rows) and the device keeps its own
rows: those at ``axis_index * rows``. With the same key on every device (the
engine folds only the step into it), each example then sees the numbers it
would see on one device, bit for bit, however the batch is split. A
``random_split`` into ``rows`` keys (Equinox's per-example keys under
``vmap``) is treated the same way. Draws of other shapes (a noise on a
weight, a scalar) are the same on every device, as on one device.

How: ``fn`` is traced to a jaxpr and evaluated equation by equation (as
``jax.core.eval_jaxpr`` does in jax 0.10: ``get_bind_params``, then ``bind``),
with those draws replaced; sub-jaxprs that
contain such a draw (``jit``, ``scan``, ``cond``, ``while``, ``remat``, custom
derivatives) are rewritten the same way. The cost is the random bits of the
global batch on every device (``N`` times the bits of its slice), which on
the models measured is small next to their matmuls (docs/guides/engine.md).
A draw whose leading axis happens to have the batch's length but is not per
example (a ``[rows, rows]`` noise) is also drawn per example; pass
``DataParallel(rng="device")`` for the classic per-device key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax

from jddp import runtime

DATA = runtime.DATA_AXIS
_DRAWS = frozenset({"random_bits", "random_split"})


def per_example(fn: Callable, rows: int, total: int, axis: str = DATA, *, draws: bool = True) -> Callable:
    """``fn`` traced as under plain ``jit``, and with ``draws`` its per-example random draws made for the global
    batch and sliced to this device's rows.

    ``fn`` is traced on abstract values without the manual mesh's sharding (with ``axis`` in its axis
    environment, for the model's own collectives), so that it sees the arrays plain ``jit`` would give it: a
    library that compares an argument's ``jax.eval_shape`` with a constant's (Equinox's ``State.set``, in
    ``eqx.nn.BatchNorm``) accepts them. The jaxpr is then evaluated in the device program.

    Args:
      fn: a function traced inside ``shard_map`` over ``axis``, given this device's ``rows`` of a global batch of
        ``total`` rows split evenly over the devices in order (device ``i`` holds rows ``i * rows`` on).
      rows: the rows of the batch ``fn`` sees.
      total: the rows of the global batch.
      axis: the mesh axis the batch is split over.
      draws: rewrite the per-example random draws (``DataParallel(rng="example")``); else only trace.

    Returns:
      A function of the same arguments and results.
    """

    @functools.wraps(fn)
    def wrapped(*args):
        leaves = jax.tree.leaves(args)
        abstract = jax.tree.unflatten(
            jax.tree.structure(args), [jax.ShapeDtypeStruct(jnp.shape(x), _dtype(x)) for x in leaves]
        )
        # Outside the device program's manual mesh: the values fn makes carry no mesh sharding either.
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
            closed, shapes = jax.make_jaxpr(fn, axis_env=[(axis, total // rows)], return_shape=True)(*abstract)
        rewrite = _Rewrite(rows, total, axis)
        if not draws or rows == total or not rewrite.draws(closed.jaxpr):
            outs = jex.core.jaxpr_as_fun(closed)(*leaves)
        else:
            outs = rewrite.eval(closed.jaxpr, closed.consts, leaves)
        return jax.tree.unflatten(jax.tree.structure(shapes), list(outs))

    return wrapped


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


class _Rewrite:
    def __init__(self, rows: int, total: int, axis: str):
        self.rows, self.total, self.axis = rows, total, axis

    def _is_per_example(self, eqn) -> bool:
        if eqn.primitive.name not in _DRAWS:
            return False
        shape = eqn.params.get("shape", ())
        key_shape = getattr(eqn.invars[0].aval, "shape", None)
        return key_shape == () and len(shape) > 0 and shape[0] == self.rows

    def draws(self, jaxpr) -> bool:
        """Whether ``jaxpr`` or one of its sub-jaxprs makes a per-example draw."""
        for eqn in jaxpr.eqns:
            if self._is_per_example(eqn):
                return True
            if any(self.draws(_inner(sub)) for sub in _subjaxprs(eqn.params)):
                return True
        return False

    def eval(self, jaxpr, consts, args) -> list:
        env: dict = {}

        def read(atom):
            return atom.val if isinstance(atom, jex.core.Literal) else env[atom]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        for var, value in zip(jaxpr.invars, args, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            invals = [read(a) for a in eqn.invars]
            if self._is_per_example(eqn):
                outs = [self._draw(eqn, invals[0])]
            else:
                params = eqn.primitive.get_bind_params({k: self._param(v) for k, v in eqn.params.items()})
                with eqn.ctx.manager:  # the equation's context (its sharding and compute settings), as eval_jaxpr
                    outs = eqn.primitive.bind(*invals, **params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            for var, value in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jex.core.DropVar):
                    env[var] = value
        return [read(a) for a in jaxpr.outvars]

    def _draw(self, eqn, key):
        shape = eqn.params["shape"]
        whole = eqn.primitive.bind(key, **{**eqn.params, "shape": (self.total, *shape[1:])})
        start = lax.axis_index(self.axis) * self.rows
        return lax.dynamic_slice_in_dim(whole, start, self.rows, 0)

    def _param(self, value):
        """A parameter with each sub-jaxpr that draws per example rewritten (others kept as they are)."""
        if isinstance(value, jex.core.ClosedJaxpr):
            return self._closed(value) if self.draws(value.jaxpr) else value
        if isinstance(value, jex.core.Jaxpr):
            if not self.draws(value):
                return value
            closed = self._closed(jex.core.ClosedJaxpr(value, ()))
            return closed.jaxpr if not closed.consts else value  # an open jaxpr cannot take the new constants
        if isinstance(value, tuple) and value and all(isinstance(v, jex.core.ClosedJaxpr) for v in value):
            return tuple(self._param(v) for v in value)
        return value

    def _closed(self, closed):
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in closed.in_avals]
        return jax.make_jaxpr(lambda *a: self.eval(closed.jaxpr, closed.consts, list(a)))(*avals)


def _inner(sub):
    return sub.jaxpr if isinstance(sub, jex.core.ClosedJaxpr) else sub


def _subjaxprs(params) -> list:
    out = []
    for value in params.values():
        if isinstance(value, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
            out.append(value)
        elif isinstance(value, tuple):
            out.extend(v for v in value if isinstance(v, (jex.core.ClosedJaxpr, jex.core.Jaxpr)))
    return out
