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
rows: those at ``axis_index * rows`` (or of its micro-batch, below). With the same key on every device (the
engine folds only the step into it), each example then sees the numbers it
would see on one device, bit for bit, however the batch is split. With
``accumulate_steps`` the device's rows are that many micro-batches of
``rows``; each draws with the same key, and keeps the rows of its place in the
global batch: micro-batch ``i`` of device ``d`` holds the rows
``d * k * rows + i + k * t`` for ``t < rows`` (every ``k``-th row:
``jddp.engine.step.micro_batches``). A global batch padded past its real examples (``DataLoader(...,
max_per_device_batch_size=...)``) draws for its padded size, whose first rows
are the unpadded batch's draws with JAX's default threefry PRNG
(``jax_threefry_partitionable``: each number follows from the key and its
index alone). So a dropout run is the same run on any device count,
``accumulate_steps`` and padding. A ``random_split`` into ``rows`` keys (Equinox's per-example keys under
``vmap``) is treated the same way. Draws of other shapes (a noise on a
weight, a scalar) are the same on every device, as on one device.

How: ``fn`` is traced to a jaxpr and evaluated equation by equation (as
``jax.core.eval_jaxpr`` does in jax 0.10: ``get_bind_params``, then ``bind``),
with those draws replaced; sub-jaxprs that
contain such a draw (``jit``, ``scan``, ``cond``, ``while``, ``remat``, custom
derivatives) are rewritten the same way. The cost is the random bits of the
global batch on every device and micro-batch (``N * k`` times the bits of
its rows), which on the models measured is small next to their matmuls
(docs/guides/engine.md).
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
# Calls whose jaxpr is evaluated in place when it draws per example and the micro-batch index is traced.
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}


def per_example(
    fn: Callable,
    rows: int,
    total: int,
    axis: str = DATA,
    *,
    draws: bool = True,
    accumulate_steps: int = 1,
    micro: jax.Array | int = 0,
) -> Callable:
    """``fn`` traced as under plain ``jit``, and with ``draws`` its per-example random draws made for the global
    batch and sliced to this device's rows.

    ``fn`` is traced on abstract values without the manual mesh's sharding (with ``axis`` in its axis
    environment, for the model's own collectives), so that it sees the arrays plain ``jit`` would give it: a
    library that compares an argument's ``jax.eval_shape`` with a constant's (Equinox's ``State.set``, in
    ``eqx.nn.BatchNorm``) accepts them. The jaxpr is then evaluated in the device program.

    Args:
      fn: a function traced inside ``shard_map`` over ``axis``, given ``rows`` rows of a global batch of
        ``total`` rows split evenly over the devices in order, each device's share in ``accumulate_steps``
        strided micro-batches: micro-batch ``micro`` of device ``d`` holds its rows ``micro``,
        ``micro + accumulate_steps``, ... (global rows ``d * accumulate_steps * rows + micro + accumulate_steps * t``).
      rows: the rows of the batch ``fn`` sees.
      total: the rows of the global batch (padding included).
      axis: the mesh axis the batch is split over.
      draws: rewrite the per-example random draws (``DataParallel(rng="example")``); else only trace.
      accumulate_steps: micro-batches per device.
      micro: the index of this micro-batch (a traced value inside the engine's scan).

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
            axis_env = [(axis, total // (rows * accumulate_steps))]
            closed, shapes = jax.make_jaxpr(fn, axis_env=axis_env, return_shape=True)(*abstract)
        rewrite = _Rewrite(rows, total, axis, accumulate_steps, micro)
        if draws and rewrite.traced and rewrite.nested(closed.jaxpr):
            # A draw inside a scan, cond, while, remat or custom derivative cannot read the micro-batch's index (a
            # value of the enclosing scan): each micro-batch then draws with its index folded into the key (the
            # last argument, loss_fn's rng), for its own rows over the devices, which agrees across layouts of
            # the same device count and accumulate_steps only.
            if _is_key(args[-1]):
                args = (*args[:-1], jax.random.fold_in(args[-1], micro))
                leaves = jax.tree.leaves(args)
            rewrite = _Rewrite(rows, total // accumulate_steps, axis)
        if not draws or rows == rewrite.total or not rewrite.draws(closed.jaxpr):
            outs = jex.core.jaxpr_as_fun(closed)(*leaves)
        else:
            outs = rewrite.eval(closed.jaxpr, closed.consts, leaves)
        return jax.tree.unflatten(jax.tree.structure(shapes), list(outs))

    return wrapped


def _is_key(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key) and jnp.shape(x) == ()


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else jnp.result_type(x)


class _Rewrite:
    def __init__(self, rows: int, total: int, axis: str, accumulate_steps: int = 1, micro: jax.Array | int = 0):
        self.rows, self.total, self.axis = rows, total, axis
        self.accumulate_steps, self.micro = accumulate_steps, micro
        # A traced micro-batch index (the engine's scan) cannot be closed over by a rewritten sub-jaxpr: calls are
        # then evaluated in place (``_inlined``) and other sub-jaxprs that draw are refused by ``nested``.
        self.traced = not isinstance(micro, int)

    def _inlined(self, eqn):
        """The jaxpr of a call (``jit``) to evaluate in place, or None."""
        name = _CALLS.get(eqn.primitive.name)
        if not self.traced or name is None:
            return None
        sub = eqn.params.get(name)
        return sub if sub is not None and self.draws(_inner(sub)) else None

    def nested(self, jaxpr) -> bool:
        """Whether a per-example draw of ``jaxpr`` lies inside a sub-jaxpr that is not a call."""
        for eqn in jaxpr.eqns:
            name = _CALLS.get(eqn.primitive.name)
            subs = [_inner(sub) for sub in _subjaxprs(eqn.params)]
            if name is not None:
                if any(self.nested(sub) for sub in subs):
                    return True
            elif any(self.draws(sub) for sub in subs):
                return True
        return False

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
            inlined = self._inlined(eqn)
            if self._is_per_example(eqn):
                outs = [self._draw(eqn, invals[0])]
            elif inlined is not None:
                outs = self.eval(_inner(inlined), getattr(inlined, "consts", []), invals)
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
        k = self.accumulate_steps
        device = lax.dynamic_slice_in_dim(whole, lax.axis_index(self.axis) * self.rows * k, self.rows * k, 0)
        if k == 1:
            return device
        # Micro-batch ``micro`` holds the device's rows micro, micro + k, ... (``jddp.engine.step.micro_batches``).
        strided = device.reshape(self.rows, k, *device.shape[1:])
        return lax.dynamic_index_in_dim(strided, self.micro, axis=1, keepdims=False)

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
