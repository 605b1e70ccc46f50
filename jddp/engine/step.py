"""The device side of a training step: what each device runs inside ``jit(shard_map(...))``.

``DeviceStep.local_step``: local gradients (a ``lax.scan`` over micro-batches
with ``accumulate_steps``), one all-reduce of gradients, loss and metric totals,
counts and unsynchronised model state, then the update, identical on every
replica. ``DeviceStep.local_eval``: exact global means of the evaluation
metrics. ``jddp.engine.parallel.DataParallel`` compiles and calls them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeAlias, cast

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jddp import runtime
from jddp import typing as jt
from jddp.engine import checks, contracts, fused, loss_scale, reduce, varying
from jddp.engine import rng as rng_lib
from jddp.runtime import packing
from jddp.runtime import state as state_lib
from jddp.runtime.layout import LeafLayout

DATA = runtime.DATA_AXIS
# The state the programs take and return, without the rng key: (step, params, opt_state, model_state).
Train: TypeAlias = tuple[jax.Array, jt.Params, jt.PyTree, jt.ModelState]


@dataclasses.dataclass
class DeviceStep:
    """The per-device programs of one ``DataParallel``; ``names`` records each program's metric names."""

    loss_fn: jt.LossFn
    optimizer: optax.GradientTransformation
    eval_fn: jt.EvalFn | None
    options: checks.Options
    num_devices: int
    psum: Callable
    fuse: bool = False  # ZeRO-1's reduce-scatter in one buffer per dtype (``fused.fused_psum_scatter``)
    names: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def local_step(self, train: Train, rng: jax.Array, batch):
        state, grads, model_state, sums, state_varies = self._local(train, rng, batch)
        # The one all-reduce: gradients, loss/metric totals, counts and any
        # model state still varying, summed together (XLA emits one op; across CPU
        # processes `fused_psum` makes it one buffer per dtype, so one pass of the ring).
        synced, varying_state, unflatten_state = varying.split_varying(model_state, state_varies)
        rows = leading_size(unpacked(batch))
        sums = self._with_local(sums, grads)
        grads_sum, sums, synced_sum = self.psum((self._wire(grads, rows), sums, varying_state), DATA)
        grads_sum = self._unwire(grads_sum, rows)
        model_state = unflatten_state(synced, [x / self.num_devices for x in synced_sum])
        return self._apply(state, grads_sum, sums, model_state, rows=rows // self.options.accumulate_steps)

    def local_scatter(self, train: Train, rng: jax.Array, batch, layouts: list[LeafLayout]):
        """ZeRO-1's device part: the gradients reduce-scattered, each leaf along its layout's dimension (padded
        to it first), so that each device receives the sum of its slice only; then one all-reduce of the loss
        and metric totals, counts, unsynchronised model state, the leaves too small to split, and each device's
        partial sum of squares of its slices (the global gradient norm, so that clipping and the non-finite guard
        read the same value on every device). Returns the stored-shape gradient slices, the sums, the synchronised
        model state and the squared global norm of the gradient sum; the update runs outside ``shard_map``
        (``jddp.engine.zero``)."""
        _, grads, model_state, sums, state_varies = self._local(train, rng, batch)
        synced, varying_state, unflatten_state = varying.split_varying(model_state, state_varies)
        rows = leading_size(unpacked(batch))
        sums = self._with_local(sums, grads)
        leaves, treedef = jax.tree.flatten(self._wire(grads, rows))
        split = [i for i, layout in enumerate(layouts) if layout.axis is not None]
        padded = [layouts[i].pad(leaves[i]) for i in split]
        if self.fuse:
            scattered = fused.fused_psum_scatter(padded, [layouts[i] for i in split], DATA, self.num_devices)
        else:
            scattered = [
                lax.psum_scatter(g, DATA, scatter_dimension=int(layouts[i].axis or 0), tiled=True)
                for g, i in zip(padded, split, strict=True)
            ]
        scattered = self._unwire(scattered, rows)
        square_dtype = reduce.sum_dtype(*(g.dtype for g in leaves))
        squares = optax.tree.norm(scattered, squared=True).astype(square_dtype)  # the padding adds zeros
        whole = [g for g, layout in zip(leaves, layouts, strict=True) if layout.axis is None]
        sums, synced_sum, whole, squares = self.psum((sums, varying_state, whole, squares), DATA)
        whole = self._unwire(whole, rows)
        squares = squares + optax.tree.norm(whole, squared=True).astype(square_dtype)  # summed whole: once
        out = list(whole)
        for i, g in zip(split, scattered, strict=True):
            out.insert(i, g)
        model_state = unflatten_state(synced, [x / self.num_devices for x in synced_sum])
        return jax.tree.unflatten(treedef, out), sums, model_state, squares

    def _local(self, train: Train, rng: jax.Array, batch):
        """This device's gradients of the loss total, its model state, its sums (loss, count, metrics), and which
        model-state leaves differ across devices (``varying.traced``: from the jaxpr, since the program runs with
        ``check_vma=False``)."""
        state = state_lib.TrainState(*train, rng)
        args = (train, rng, batch)
        traced = varying.traced(self._device_grads, args, (False, False, True), inputs=True)
        (grads, model_state, sums), flags, depends = cast("tuple[Any, Any, Any]", traced)
        contracts.warn_if_constant("loss_fn", [not d for d in jax.tree.leaves(depends[0])])
        return state, grads, model_state, sums, flags[1]

    def _device_grads(self, train: Train, rng: jax.Array, batch):
        state = state_lib.TrainState(*train, rng)
        batch = unpacked(batch)
        key = self._key(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
        # The parameters as they are: under ``check_vma=False`` ``jax.grad`` gives this device's own gradient (no
        # implicit ``psum``), which the one all-reduce then sums.
        scale = loss_scale.scale_of(state.opt_state) if self.options.loss_scaled else None
        if self.options.accumulate_steps == 1:
            return self._local_grads(state.params, state.model_state, batch, key, scale)
        return self._accumulate(state.params, state.model_state, batch, key, scale)

    def _with_local(self, sums, grads):
        """``sums`` with, when ``local_metrics`` is on, this device's own loss and gradient norm (means over its
        real examples) written at its index of two length-N vectors: summed in the one all-reduce, every device
        receives every device's values (a few bytes more, no other collective)."""
        loss_w, count, aux = sums
        if not self.options.local_metrics:
            return loss_w, count, aux, {}
        weight = jnp.where(loss_w.weight > 0, loss_w.weight, 1)
        here = lax.axis_index(DATA)
        values = {"local_loss": loss_w.total / weight, "local_grad_norm": optax.tree.norm(grads) / weight}
        return loss_w, count, aux, {k: jnp.zeros(self.num_devices, v.dtype).at[here].set(v) for k, v in values.items()}

    def _cast(self, tree):
        dtype = self.options.compute_dtype
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def _key(self, key: jax.Array) -> jax.Array:
        """The key ``loss_fn`` gets on this device: the same everywhere with ``rng="example"`` (its per-example
        draws are then made for the global batch: ``_loss``), else this device's own."""
        return key if self.options.rng == "example" else jax.random.fold_in(key, lax.axis_index(DATA))

    def _loss(self, fn, batch, micro: jax.Array | None = None):
        """``fn`` (the loss function) for this device's ``batch``, traced as under plain jit; with
        ``rng="example"``, each draw along the batch's leading axis is the one its examples get on one device
        (``jddp.engine.rng``): also for micro-batch ``micro`` of ``accumulate_steps`` (None: the device's whole
        slice), by its place in the global batch."""
        rows = leading_size(batch)
        k = 1 if micro is None else self.options.accumulate_steps
        return rng_lib.per_example(
            fn,
            rows,
            rows * k * self.num_devices,
            draws=self.options.rng == "example",
            accumulate_steps=k,
            micro=0 if micro is None else micro,
        )

    def _narrow(self) -> bool:
        """Whether ``reduce_dtype`` is a float of narrow range (float16: 65504), where a sum of gradients over
        the examples of every device overflows long before their mean would."""
        wire = self.options.reduce_dtype
        return wire is not None and float(jnp.finfo(wire).max) < 1e6

    def _wire(self, grads, rows: int):
        """The gradients in the dtype they are summed in (``reduce_dtype``, else their own). In a narrow float
        they are first divided by this device's batch rows, the same static number on every device, so that
        the sum carries per-device means (as DDP's fp16 hook divides by the world size); ``_unwire`` multiplies
        it back in float32, and the result stays the exact weighted mean."""
        wire = self.options.reduce_dtype
        if wire is None:
            return grads
        if self._narrow():
            return jax.tree.map(lambda g: (g.astype(jnp.float32) / rows).astype(wire), grads)
        return jax.tree.map(lambda g: g.astype(wire), grads)

    def _unwire(self, summed, rows: int):
        return jax.tree.map(lambda g: g.astype(jnp.float32) * rows, summed) if self._narrow() else summed

    def _apply(self, state: state_lib.TrainState, grads_sum, sums, model_state, place=None, squares=None, rows=1):
        """The optimizer update from the all-reduced sums, identical on every replica.

        ZeRO-1 (outside ``shard_map``) passes ``place``, which pins the optimizer's updates and the new
        parameters to the gradients' sharding, so that XLA updates each slice where it lives and the parameters
        are gathered once, after the update; and ``squares``, the squared norm of ``grads_sum``, already summed
        over the devices.
        """
        place = place or (lambda tree: tree)
        opts = self.options
        loss_w, examples, aux, local = sums
        loss = reduce.safe_divide(loss_w.total, loss_w.weight)
        # The mean is taken in float32, or float64 when a parameter is float64 (bf16/f16 parameters: float32).
        mean_dtype = reduce.sum_dtype(*(p.dtype for p in jax.tree.leaves(state.params)))
        weight = loss_w.weight.astype(mean_dtype)
        scale = 1.0 / jnp.where(weight > 0, weight, 1.0)
        metrics = {"loss": loss, "examples": examples}
        if opts.loss_scaled:  # the gradient sums carry the loss scale over the rows: divided out with the count
            used = loss_scale.scale_of(state.opt_state)
            scale = scale * rows / used.astype(mean_dtype)
            metrics["loss_scale"] = used
        if opts.nonfinite != "ignore" or opts.clip_grad_norm is not None:
            # The norm of the mean gradient, from the sums: the mean itself is
            # only formed inside the update, where XLA fuses it into the optimizer.
            norm = optax.tree.norm(grads_sum) if squares is None else jnp.sqrt(squares)
            metrics["grad_norm"] = grad_norm = norm * scale
        if opts.clip_grad_norm is not None:
            scale = scale * jnp.where(grad_norm > opts.clip_grad_norm, opts.clip_grad_norm / grad_norm, 1.0)

        hooked = None
        if opts.grad_hook is not None:
            # The mean gradient formed here, before the branch, for the user's hook (it then feeds the update).
            grads_sum = jax.tree.map(lambda s, p: mean_of(s, p.dtype, scale), grads_sum, state.params)
            grads_sum, hooked = checks.unpack_hook(opts.grad_hook(grads_sum, state.params), grads_sum)
            scale = jnp.ones((), mean_dtype)

        def update(operands):
            grads_sum, params, opt_state, model_state, _ = operands
            grads = jax.tree.map(lambda s, p: mean_of(s, p.dtype, scale), grads_sum, params)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return place(optax.apply_updates(params, place(updates))), opt_state, model_state

        def skip(operands):
            _, params, opt_state, _, old_model_state = operands
            return place(params), opt_state, old_model_state

        operands = (grads_sum, state.params, state.opt_state, model_state, state.model_state)
        # A global batch without a real example (empty, or padding on every device) changes nothing: no decay, no
        # momentum, no statistics (``examples`` is 0 in the metrics). A branch, not a select: the common path
        # reads each buffer once.
        take = examples > 0
        if opts.nonfinite != "ignore":
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            if hooked is not None and contracts.HOOK_GRADS.guarded:  # what is applied: the hook's gradients
                finite = finite & contracts.finite(grads_sum)
            metrics["nonfinite"] = (~finite).astype(jnp.float32)
            take = take & finite
        params, opt_state, model_state = lax.cond(take, update, skip, operands)
        if opts.loss_scaled:
            opt_state = loss_scale.adjusted(opt_state, finite)
        checks.check_metric_names(aux, metrics)
        metrics.update({k: reduce.safe_divide(w.total, w.weight) for k, w in aux.items()})
        checks.check_metric_names(hooked or {}, metrics)
        metrics.update(hooked or {})
        for name, vector in local.items():  # every device's own value, by device index
            metrics.update({f"{name}/{i}": vector[i] for i in range(self.num_devices)})
        # Each mean's weight follows the values (as eval's do), so that means over many steps are exact for a
        # ``Weighted`` loss or metric too (tokens, not examples): ``RunningMeans``.
        weights = {"loss": loss_w.weight, **{k: w.weight for k, w in aux.items()}}
        packed = self._pack("step", metrics)
        row = jnp.stack([jnp.asarray(weights.get(k, examples), packed.dtype) for k in metrics])
        return (state.step + 1, params, opt_state, model_state), jnp.concatenate([packed, row])

    def _pack(self, program: str, metrics: dict) -> jax.Array:
        """Records the metric names (at trace time) and stacks the values (float32, or float64 if one is)."""
        self.names[program] = tuple(metrics)
        dtype = reduce.sum_dtype(*(jnp.result_type(v) for v in metrics.values()))
        return jnp.stack([jnp.asarray(v, dtype) for v in metrics.values()])

    def _local_grads(self, params, model_state, batch, key, scale=None, micro=None):
        """Local gradient of the loss *total* (times the loss ``scale`` under float16 compute) and the local
        sums; ``micro``: the index of the micro-batch ``batch`` is (``_accumulate``)."""
        count = reduce.example_count(batch, leading_size(batch))

        def objective(params):
            loss_fn = self._loss(checked_loss_fn(self.loss_fn), batch, micro)
            # compute_dtype: the float params and batch arrays cast for the forward and backward pass; the cast's
            # transpose gives the gradient back in the parameters' own dtype.
            p, b = (params, batch) if self.options.compute_dtype is None else self._cast((params, batch))
            loss, (new_model_state, aux) = loss_fn(p, model_state, b, key)
            loss_w = reduce.as_weighted(loss, count, "The loss returned by `loss_fn`")
            aux_w = {k: reduce.as_weighted(v, count, f"Metric {k!r} returned by `loss_fn`") for k, v in aux.items()}
            # The loss scale multiplies the mean (as GradScaler's), not the total over this slice's rows.
            scaled = loss_w.total if scale is None else loss_w.total * (scale / leading_size(batch))
            return scaled, (loss_w, new_model_state, aux_w)

        (_, (loss_w, new_model_state, aux_w)), grads = jax.value_and_grad(objective, has_aux=True)(params)
        return grads, new_model_state, (loss_w, count, aux_w)

    def _accumulate(self, params, model_state, batch, key, scale=None):
        """Sums local gradients over micro-batches in a scan: no collective inside. The model state is carried
        from one micro-batch to the next, as a loop over them would. With ``rng="example"`` every micro-batch
        gets the step's key, and its per-example draws are those of its rows' places in the global batch
        (``_loss``), so that they do not depend on ``accumulate_steps`` or the device count; with
        ``rng="device"`` the micro-batch's index is folded into the device's key."""
        k = self.options.accumulate_steps
        micro = jax.tree.map(functools.partial(micro_batches, k=k), batch)
        first = jax.tree.map(lambda x: x[0], micro)
        shapes = jax.eval_shape(self._local_grads, params, model_state, first, key, scale, 0)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[0], shapes[2]))
        per_example = self.options.rng == "example"

        def body(carry, xs):
            grads_acc, ms, sums_acc = carry
            mb, i = xs
            g, ms, s = self._local_grads(params, ms, mb, key if per_example else jax.random.fold_in(key, i), scale, i)
            add = functools.partial(jax.tree.map, jnp.add)
            return (add(grads_acc, g), ms, add(sums_acc, s)), None

        init = (zeros[0], model_state, zeros[1])
        (grads, model_state, sums), _ = lax.scan(body, init, (micro, jnp.arange(k)))
        return grads, model_state, sums

    def local_eval(self, train: Train, rng: jax.Array, batch):
        state = state_lib.TrainState(*train, rng)
        batch = unpacked(batch)
        count = reduce.example_count(batch, leading_size(batch))
        if self.eval_fn is None:
            key = self._key(jax.random.wrap_key_data(state.rng))
            loss_fn = self._loss(checked_loss_fn(self.loss_fn), batch)
            # A metric named "loss" would overwrite the loss here: the contract refuses it, as in the step.
            loss, (_, aux) = loss_fn(state.params, state.model_state, batch, key)
            metrics = {"loss": loss, **aux}
        else:
            metrics = self.eval_fn(state.params, state.model_state, batch)
            contracts.check(contracts.EVAL_METRICS, metrics)
        sums = {k: reduce.as_weighted(v, count, f"Metric {k!r}") for k, v in metrics.items()}
        sums, examples = self.psum((sums, count), DATA)
        metrics = {k: reduce.safe_divide(w.total, w.weight) for k, w in sums.items()}
        checks.check_metric_names(metrics, {"examples": examples})
        packed = self._pack("eval", {**metrics, "examples": examples})
        # The weights follow the values, so that `evaluate` can combine batches exactly.
        return jnp.concatenate([packed, jnp.stack([w.weight for w in sums.values()])])


def checked_loss_fn(loss_fn: jt.LossFn) -> jt.LossFn:
    """``loss_fn`` whose result is checked against its contracts (``contracts.LOSS``, ``MODEL_STATE``,
    ``LOSS_METRICS``) where it returns, on abstract values while JAX traces it: nothing of it runs in the program."""

    def checked(params, model_state, batch, key):
        # The model state's avals before the call: a model may forbid reading its old state afterwards (Equinox).
        before = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), x.dtype), model_state)
        loss, (new_model_state, metrics) = checks.unpack_loss(loss_fn(params, model_state, batch, key))
        contracts.check(contracts.LOSS, loss)
        contracts.check(contracts.MODEL_STATE, new_model_state, before)
        contracts.check(contracts.LOSS_METRICS, metrics)
        return loss, (new_model_state, metrics)

    return checked


def mean_of(grad_sum: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """``grad_sum * scale`` as ``dtype``, computed in float32 or in float64 for float64 parameters."""
    compute = reduce.sum_dtype(dtype, grad_sum.dtype)
    return (grad_sum.astype(compute) * scale.astype(compute)).astype(dtype)


def micro_batches(x: jax.Array, k: int) -> jax.Array:
    """A device's rows ``[k * m, ...]`` as ``k`` micro-batches ``[k, m, ...]``, micro-batch ``i`` holding the rows
    ``i, i + k, i + 2k, ...``: since every device's slice starts at a multiple of ``k``, micro-batch ``i`` of the
    step is the global rows ``j`` with ``j % k == i`` on every device layout, so that statistics the model computes
    over a micro-batch (``BatchNorm(axis_name="data")``) are over the same examples on 1 device and on N."""
    return jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)


def unpacked(batch):
    """A ``PackedBatch`` (from ``jddp.data.DataLoader``) as its dict of arrays."""
    return packing.unpack(batch.data, batch.layout) if isinstance(batch, packing.PackedBatch) else batch


def leading_size(batch) -> int:
    return jax.tree.leaves(batch)[0].shape[0]
