"""ZeRO-1: the optimizer state split over ``"data"``, the update run where each slice lives.

``DataParallel(shard_optimizer=True)`` compiles this step instead of one
``shard_map``:

1. inside ``shard_map`` (``DeviceStep.local_scatter``), each device computes its
   local gradients as before and *reduce-scatters* them: each device receives
   the global sum of its slice of every gradient leaf (the leaf's
   ``LeafLayout`` dimension, padded to a multiple of the device count). Loss and
   metric totals, counts and unsynchronised model state are all-reduced as in
   the replicated engine;
2. outside it, under the same ``jit``, the update is the replicated engine's
   ``DeviceStep._apply`` on global arrays: gradients and optimizer state split,
   parameters replicated. XLA's SPMD partitioner runs each elementwise part of
   the update on the device that holds the slice, sums the partial squares of
   the global gradient norm with one all-reduce (clipping and the non-finite
   guard read the same value on every device), and all-gathers the new
   parameters once, which the output sharding asks for.

Each device holds ``1/N`` of the optimizer state and of the gradient sums; the
parameters and the model state stay replicated. A ring reduce-scatter and a
ring all-gather move ``(N-1)/N`` of the gradient bytes each: together what the
all-reduce they replace moves (``CommReport.wire_bytes``).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jddp import runtime
from jddp.engine import fused
from jddp.engine import step as step_lib
from jddp.runtime import layout as layout_lib
from jddp.runtime import state as state_lib
from jddp.runtime.layout import LeafLayout

DATA = runtime.DATA_AXIS


def leaf_layouts(tree, num_devices: int) -> tuple[LeafLayout, ...]:
    """The layout of every leaf of ``tree`` (arrays or shape structs) over ``num_devices``."""
    return tuple(layout_lib.choose(np.shape(x), num_devices) for x in jax.tree.leaves(tree))


def opt_layouts(optimizer: optax.GradientTransformation, params, num_devices: int) -> tuple[LeafLayout, ...]:
    """The layout of every leaf of ``optimizer.init(params)``, from its shapes (nothing is computed)."""
    return leaf_layouts(jax.eval_shape(optimizer.init, params), num_devices)


def pad(layouts: tuple[LeafLayout, ...], tree):
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [lay.pad(x) for lay, x in zip(layouts, leaves, strict=True)])


def unpad(layouts: tuple[LeafLayout, ...], tree):
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [lay.unpad(x) for lay, x in zip(layouts, leaves, strict=True)])


def shardings(layouts: tuple[LeafLayout, ...], treedef, mesh: Mesh):
    """The stored shardings of a tree with ``treedef`` laid out as ``layouts``."""
    return jax.tree.unflatten(treedef, [NamedSharding(mesh, lay.spec()) for lay in layouts])


def constrain(layouts: tuple[LeafLayout, ...], tree, mesh: Mesh):
    """``tree`` (logical shapes) pinned to its layouts' shardings: split leaves stay on the device of their slice."""
    leaves, treedef = jax.tree.flatten(tree)
    placed = [
        jax.lax.with_sharding_constraint(x, NamedSharding(mesh, lay.spec()))
        for lay, x in zip(layouts, leaves, strict=True)
    ]
    return jax.tree.unflatten(treedef, placed)


def step_program(device: step_lib.DeviceStep, mesh: Mesh, opt: tuple[LeafLayout, ...], opt_treedef, *, donate: bool):
    """The jitted ZeRO-1 step ``((step, params, opt_state, model_state), rng, batch) -> (new state, packed metrics)``
    for an optimizer state stored as ``opt``."""
    num_devices = mesh.shape[DATA]
    rep, batch_sharding = runtime.replicated(mesh), runtime.batch_sharding(mesh)
    opt_sharding = shardings(opt, opt_treedef, mesh)

    def program(train, rng, batch):
        step, params, opt_state, model_state = train
        grads_layout = leaf_layouts(params, num_devices)
        specs = jax.tree.unflatten(jax.tree.structure(params), [lay.spec() for lay in grads_layout])
        local = jax.shard_map(
            functools.partial(device.local_scatter, layouts=list(grads_layout)),
            mesh=mesh,
            in_specs=(P(), P(), P(DATA)),
            out_specs=(specs, P(), P(), P()),
            check_vma=False,  # the user's code as under plain jit (``jddp.engine.varying``)
        )
        grads_sum, sums, new_model_state, squares = local((step, params, None, model_state), rng, batch)
        state = state_lib.TrainState(step, params, unpad(opt, opt_state), model_state, rng)
        grads_sum = constrain(grads_layout, unpad(grads_layout, grads_sum), mesh)
        place = functools.partial(constrain, grads_layout, mesh=mesh)
        (step, params, opt_state, model_state), packed = device._apply(
            state, grads_sum, sums, new_model_state, place=place, squares=squares
        )
        if device.fuse:
            params = gather(grads_layout, params, mesh)
        opt_state = jax.tree.map(jax.lax.with_sharding_constraint, pad(opt, opt_state), opt_sharding)
        return (step, params, opt_state, model_state), packed

    train_sharding = (rep, rep, opt_sharding, rep)
    return jax.jit(
        program,
        in_shardings=(train_sharding, rep, batch_sharding),
        out_shardings=(train_sharding, rep),
        donate_argnums=(0,) if donate else (),
    )


def gather(layouts: tuple[LeafLayout, ...], tree, mesh: Mesh):
    """``tree`` (split as ``layouts``) made whole on every device by ``fused.fused_all_gather``: one all-gather
    per dtype for the small leaves, instead of the one per leaf that the partitioner emits."""
    leaves, treedef = jax.tree.flatten(tree)
    split = [i for i, lay in enumerate(layouts) if lay.axis is not None]
    stored = [
        jax.lax.with_sharding_constraint(layouts[i].pad(leaves[i]), NamedSharding(mesh, layouts[i].spec()))
        for i in split
    ]

    def local(slices):
        return fused.fused_all_gather(slices, [layouts[i] for i in split], DATA, mesh.shape[DATA])

    whole = jax.shard_map(local, mesh=mesh, in_specs=([layouts[i].spec() for i in split],), out_specs=P())(stored)
    out = list(leaves)
    for i, x in zip(split, whole, strict=True):
        out[i] = layouts[i].unpad(x)
    return jax.tree.unflatten(treedef, out)


def init_program(optimizer: optax.GradientTransformation, opt: tuple[LeafLayout, ...], opt_treedef, mesh: Mesh):
    """``optimizer.init`` compiled to write the state stored as ``opt``: each device builds only its slices."""
    return jax.jit(lambda params: pad(opt, optimizer.init(params)), out_shardings=shardings(opt, opt_treedef, mesh))


def state_bytes(tree) -> dict[int, int]:
    """Bytes of ``tree``'s live buffers on each local device (device id to bytes), read from the arrays' shards."""
    per_device: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            for shard in x.addressable_shards:
                per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return per_device
