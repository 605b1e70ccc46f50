"""`DataParallel`: DDP's training step as one ``jit(shard_map(...))`` program."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any, Literal, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp import runtime, validate
from jddp import typing as jt
from jddp.engine import comm, fused, reduce, replicas
from jddp.engine import metrics as metrics_lib
from jddp.runtime import dispatch, jax_internals, packing
from jddp.runtime import state as state_lib

DATA = runtime.DATA_AXIS
# The state the programs take and return, without the rng key: (step, params, opt_state, model_state).
_Train: TypeAlias = tuple[jax.Array, jt.Params, jt.PyTree, jt.ModelState]

MSG_LOSS_OUTPUT = (
    "`loss_fn` must return `(loss, (new_model_state, metrics))`, where `loss` is a "
    "scalar mean over the local batch's real examples or a `jddp.Weighted(total, "
    "weight)`, `new_model_state` is the model state (`{{}}` if none) and `metrics` a "
    "dict of scalars. It returned {got}."
)


class NonFiniteError(FloatingPointError):
    """A step produced a non-finite loss or gradient (``nonfinite="raise"``).

    The update was not applied; ``state`` is the state after the skipped step,
    so a caller can checkpoint it or lower the learning rate and go on.
    """

    def __init__(self, message: str, state: state_lib.TrainState):
        super().__init__(message)
        self.state = state


@dataclasses.dataclass(frozen=True)
class _Options:
    accumulate_steps: int
    reduce_dtype: Any
    clip_grad_norm: float | None
    nonfinite: str
    donate: bool
    max_inflight: int
    fuse_allreduce: bool | None

    def __post_init__(self):
        validate.check_int("accumulate_steps", self.accumulate_steps)
        if self.reduce_dtype is not None and not jnp.issubdtype(self.reduce_dtype, jnp.floating):
            raise ValueError(
                f"`reduce_dtype` must be a float dtype such as jnp.bfloat16 or None, "
                f"got reduce_dtype={self.reduce_dtype!r}."
            )
        c = self.clip_grad_norm
        if c is not None and not (isinstance(c, int | float) and c > 0 and np.isfinite(c)):
            raise ValueError(f"`clip_grad_norm` must be a positive number or None, got clip_grad_norm={c!r}.")
        if self.nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"`nonfinite` must be 'skip', 'raise' or 'ignore', got nonfinite={self.nonfinite!r}.")
        validate.check_int("max_inflight", self.max_inflight)
        if self.fuse_allreduce is not None and not isinstance(self.fuse_allreduce, bool):
            raise ValueError(
                f"`fuse_allreduce` must be True, False or None (automatic), got fuse_allreduce={self.fuse_allreduce!r}."
            )


class DataParallel:
    """Data-parallel training: PyTorch DDP's design on ``jit(shard_map(...))``.

    Every device holds the whole state; each takes its slice of the global
    batch, computes local gradients, and one all-reduce sums gradients,
    loss and metric totals and example counts together. Dividing once by the
    global count makes the gradient and every metric the exact mean over the
    real (``mask``-ed) examples of the global batch. Every replica applies the
    same update, so replicas stay bit-identical.

    Args:
      loss_fn: ``loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state,
        metrics))`` on one device's slice of the batch. ``loss`` is a scalar mean
        over the slice's real examples (``jddp.masked_mean``) or a
        ``jddp.Weighted(total, weight)``; metrics are scalars of the same kinds.
      optimizer: an ``optax.GradientTransformation``.
      mesh: a mesh with a ``"data"`` axis, usually ``jddp.data_mesh()``.
      accumulate_steps: micro-batches per step; gradients of the micro-batches
        are summed locally and all-reduced once (DDP's ``no_sync``).
      reduce_dtype: dtype of the gradient all-reduce (DDP's bf16 compression
        hook); ``None`` keeps the gradient dtype.
      clip_grad_norm: clip the averaged gradient to this global norm.
      nonfinite: ``"skip"``: a non-finite loss or gradient leaves params,
        optimizer and model state unchanged on every replica and is counted in
        ``metrics["nonfinite"]``; ``"raise"``: the same, then
        ``NonFiniteError`` (costs a host sync per step); ``"ignore"``: no check
        (as PyTorch DDP), saving one read of the gradient and a branch per step;
        ``grad_norm`` is then reported only with ``clip_grad_norm``.
      donate: donate the input state's buffers to the output state.
      eval_fn: ``eval_fn(params, model_state, batch) -> metrics`` for
        ``eval_step``; ``None`` reports ``loss_fn``'s loss and metrics.
      max_inflight: steps dispatched ahead of the host (see
        ``jddp.runtime.dispatch``).
      fuse_allreduce: sum the gradients and every other reduced value as one
        flat buffer per dtype (``jddp.engine.fused``; leaves over 1 MiB stay
        buffers of their own) instead of one buffer per leaf; ``None`` does so
        on CPU devices of several processes, where XLA runs one gloo ring pass
        per buffer in sequence (MNIST-1D MLP at 2 processes x 4 devices: 58 ->
        15 ms per step). Within one process it stays off: there the fused
        buffer made the same step about 10x slower
        (``benchmarks/step_overhead.py``, ``jddp unfused`` row).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jddp
      >>> def loss_fn(params, model_state, batch, rng):
      ...     err = batch["x"] @ params["w"] - batch["y"]
      ...     return jddp.masked_mean(err**2, batch.get("mask")), (model_state, {})
      >>> dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
      >>> state = dp.init({"w": np.zeros((3,), np.float32)}, rng=0)
      >>> batch = {"x": np.ones((16, 3), np.float32), "y": np.ones((16,), np.float32)}
      >>> state, metrics = dp.step(state, batch)
      >>> float(metrics["loss"]), int(state.step)
      (1.0, 1)
    """

    def __init__(
        self,
        loss_fn: jt.LossFn,
        optimizer: optax.GradientTransformation,
        *,
        mesh: Mesh,
        accumulate_steps: int = 1,
        reduce_dtype: Any = None,
        clip_grad_norm: float | None = None,
        nonfinite: Literal["skip", "raise", "ignore"] = "skip",
        donate: bool = True,
        eval_fn: jt.EvalFn | None = None,
        max_inflight: int = 2,
        fuse_allreduce: bool | None = None,
    ):
        if not callable(loss_fn):
            raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"`optimizer` must be an optax.GradientTransformation, got {type(optimizer).__name__}.")
        if not isinstance(mesh, Mesh) or DATA not in mesh.axis_names:
            raise ValueError(
                f"`mesh` must be a jax.sharding.Mesh with an axis named {DATA!r}, got {mesh!r}; use `jddp.data_mesh()`."
            )
        self.options = _Options(
            accumulate_steps, reduce_dtype, clip_grad_norm, nonfinite, donate, max_inflight, fuse_allreduce
        )
        self.loss_fn, self.optimizer, self.eval_fn, self.mesh = loss_fn, optimizer, eval_fn, mesh
        self.num_devices = mesh.shape[DATA]
        if fuse_allreduce is None:  # the same on every process: the mesh is global
            devices = list(mesh.devices.flat)
            fuse_allreduce = all(d.platform == "cpu" for d in devices) and len({d.process_index for d in devices}) > 1
        self._psum = fused.fused_psum if fuse_allreduce else lax.psum
        self._rep = runtime.replicated(mesh)
        self._batch = runtime.batch_sharding(mesh)
        self._checked: tuple | None = None
        self._names: dict[str, tuple[str, ...]] = {}
        self._step = self._compile(self._local_step, donate=donate)
        self._eval = self._compile(self._local_eval, donate=False, out_state=False)

    def _compile(self, fn, *, donate: bool, out_state: bool = True):
        # Programs take (step, params, opt_state, model_state), the rng key data
        # and the batch; the key is not donated nor returned (it never changes),
        # and the metrics come back packed in one vector: fewer buffers per call.
        out_specs = (P(), P()) if out_state else P()
        mapped = jax.shard_map(fn, mesh=self.mesh, in_specs=(P(), P(), P(DATA)), out_specs=out_specs)
        out_shardings = (self._rep, self._rep) if out_state else self._rep
        return jax.jit(
            mapped,
            in_shardings=(self._rep, self._rep, self._batch),
            out_shardings=out_shardings,
            donate_argnums=(0,) if donate else (),
        )

    def _args(self, state: state_lib.TrainState, batch):
        return (state.step, state.params, state.opt_state, state.model_state), state.rng, batch

    # ----------------------------------------------------------------- init

    def init(
        self,
        params: jt.Params,
        model_state: jt.ModelState = None,
        rng: jax.Array | int = 0,
    ) -> state_lib.TrainState:
        """Builds the replicated ``TrainState``.

        The state is made from host copies of ``params`` and ``model_state``, so
        donating it later never deletes the caller's arrays. In a run of several
        processes, every replica starts from process 0's values (broadcast, as
        DDP's constructor does), and a checksum of the placed state is compared
        across processes.

        Args:
          params: a pytree of arrays (NumPy or JAX).
          model_state: non-trainable variables (BatchNorm statistics), or None.
          rng: a key from ``jax.random.key``/``PRNGKey`` or an int seed.

        Returns:
          A ``TrainState`` whose leaves are replicated over the mesh.

        Raises:
          TypeError: if a leaf of ``params`` or ``model_state`` is not an array.
          AssertionError: if, after the broadcast, a process holds other values
            (names the process and the leaf).
        """
        params = _host_copy(params, "params")
        model_state = _host_copy({} if model_state is None else model_state, "model_state")
        key = _key_data(rng)
        dispatch.DISPATCHER.drain()
        params, model_state, key = replicas.broadcast_from_process_0((params, model_state, key))
        put = functools.partial(replicas.put_replicated, sharding=self._rep)
        params = jax.tree.map(put, params)
        opt_state = jax.jit(self.optimizer.init, out_shardings=self._rep)(params)
        state = state_lib.TrainState(
            step=put(np.zeros((), np.int32)),
            params=params,
            opt_state=opt_state,
            model_state=jax.tree.map(put, model_state),
            rng=put(key),
        )
        replicas.assert_same_on_every_process(state, "state")
        return state

    # ----------------------------------------------------------------- step

    def step(self, state: state_lib.TrainState, batch: jt.Batch) -> tuple[state_lib.TrainState, metrics_lib.Metrics]:
        """One training step on a global batch.

        Args:
          state: from ``init`` or a previous ``step``; donated when ``donate``.
          batch: a pytree of arrays with leading axis of size ``global_batch_size``
            (sharded over ``"data"``, or NumPy in a single process); an optional
            ``batch["mask"]`` of 0/1 marks real examples.

        Returns:
          ``(new_state, metrics)``; ``metrics`` maps names to floats, read from
          the device on first access (``jddp.engine.metrics.Metrics``): ``loss``,
          ``examples`` (real examples in the global batch), ``grad_norm``
          (before clipping) and ``nonfinite`` (1 if the update was skipped)
          unless ``nonfinite="ignore"``, and the ``loss_fn``'s metrics, all
          exact global means.

        Raises:
          ValueError: for a batch the mesh cannot split or a state from another mesh.
          NonFiniteError: with ``nonfinite="raise"``, after a skipped update.
        """
        self._check_call(state, batch)
        dispatch.DISPATCHER.before(self._step, self.options.max_inflight)
        (step, params, opt_state, model_state), packed = self._step(*self._args(state, batch))
        dispatch.DISPATCHER.after(packed)
        state = state_lib.TrainState(step, params, opt_state, model_state, state.rng)
        metrics = metrics_lib.Metrics(self._names["step"], packed)
        if self.options.nonfinite == "raise" and metrics["nonfinite"]:
            step = int(state.step) - 1
            raise NonFiniteError(
                f"Non-finite loss or gradient at step={step} (loss={float(metrics['loss'])}, "
                f"grad_norm={float(metrics['grad_norm'])}); the update was skipped. Use "
                "`nonfinite='skip'` to go on, or lower the learning rate.",
                state,
            )
        return state, metrics

    def eval_step(self, state: state_lib.TrainState, batch: jt.Batch) -> metrics_lib.Metrics:
        """Exact global means of the evaluation metrics over the batch's real examples.

        Args:
          state: a ``TrainState`` (not donated).
          batch: as for ``step``; pad the last batch and mask the padding.

        Returns:
          ``Metrics`` (names to floats), plus ``examples``, the real examples counted.
        """
        self._check_call(state, batch)
        dispatch.DISPATCHER.before(self._eval, self.options.max_inflight)
        packed = self._eval(*self._args(state, batch))
        dispatch.DISPATCHER.after(packed)
        return metrics_lib.Metrics(self._names["eval"], packed)

    def evaluate(self, state: state_lib.TrainState, batches: Iterable[jt.Batch]) -> dict[str, float]:
        """Exact means of the evaluation metrics over every real example of ``batches``.

        Each batch's means are combined with their weights (real examples, or
        the ``Weighted`` weights), so the result equals one pass over the whole
        data on one device. Pair it with ``jddp.data.DataLoader(...,
        shuffle=False, drop_last=False)``: one epoch covers every example once,
        the padding masked.

        Returns:
          Metric names to floats, plus ``examples``, the real examples seen.
        """
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        examples = 0.0
        for batch in batches:
            m = self.eval_step(state, batch)
            for name, weight in m.weights.items():
                totals[name] = totals.get(name, 0.0) + m[name] * weight
                weights[name] = weights.get(name, 0.0) + weight
            examples += m["examples"]
        means = {k: totals[k] / weights[k] if weights[k] else 0.0 for k in totals}
        return {**means, "examples": examples}

    def comm_report(self, state: state_lib.TrainState, batch: jt.Batch) -> comm.CommReport:
        """The collectives of the compiled step (op, operands, dtype, bytes), and in ``lowered`` as asked for.

        Compiling for the report does not run the step or touch ``state``.
        """
        self._check_call(state, batch)
        lowered = self._step.lower(*self._args(state, batch))
        hlo = lowered.compile().as_text()
        if hlo is None:
            raise RuntimeError("The backend gives no compiled HLO text, so the step's collectives cannot be listed.")
        return comm.CommReport.from_hlo(hlo, reduce_dtype=self.options.reduce_dtype, lowered_text=lowered.as_text())

    def assert_replicas_identical(self, state: state_lib.TrainState) -> None:
        """Raises ``AssertionError`` naming the leaf and the device or process where replicas differ.

        In a run of several processes this is a collective: call it on every process.
        """
        dispatch.DISPATCHER.drain()
        replicas.assert_identical(state)
        replicas.assert_same_on_every_process(state, "state")

    # ------------------------------------------------------------ validation

    def _check_call(self, state, batch) -> None:
        if not isinstance(state, state_lib.TrainState):
            raise TypeError(f"`state` must be a jddp.TrainState from `init`, got {type(state).__name__}.")
        sharding = getattr(state.step, "sharding", None)
        if sharding is not self._rep and sharding != self._rep:
            raise ValueError(
                f"`state` lives on another mesh: its sharding is {sharding}, but this DataParallel "
                f"uses {self._rep}. Build the state with this object's `init`, or restore the "
                "checkpoint onto this mesh."
            )
        leaves, treedef = jax.tree.flatten(batch)
        signature = (treedef, tuple(np.shape(x) for x in leaves))
        if signature != self._checked:
            self._check_batch(batch, leaves)
            self._checked = signature

    def _check_batch(self, batch, leaves) -> None:
        if not leaves:
            raise ValueError("`batch` has no array leaves; pass a dict of arrays with a batch axis.")
        sizes = {jax.tree_util.keystr(path): np.shape(x)[:1] for path, x in jax.tree.leaves_with_path(batch)}
        leading = {s[0] if s else None for s in sizes.values()}
        if len(leading) != 1 or None in leading:
            raise ValueError(
                "Every leaf of `batch` must have the same leading (batch) size, got "
                + ", ".join(f"{k}: {v[0] if v else 'scalar'}" for k, v in sizes.items())
                + "."
            )
        (size,) = leading
        n, k = self.num_devices, self.options.accumulate_steps
        if size % (n * k):
            raise ValueError(
                f"The global batch size must be divisible by the number of devices times "
                f"`accumulate_steps`, got global_batch_size={size}, devices={n}, "
                f"accumulate_steps={k}. Use a global batch size that is a multiple of {n * k}."
            )
        if jax.process_count() > 1 and not all(isinstance(x, jax.Array) for x in leaves):
            raise TypeError(
                "In a multi-process run every batch leaf must be a global jax.Array; use "
                "`jddp.data.DataLoader` or `jax.make_array_from_process_local_data`."
            )

    # --------------------------------------------------------- device code

    def _local_step(self, train: _Train, rng: jax.Array, batch):
        opts = self.options
        state = state_lib.TrainState(*train, rng)
        batch = _unpacked(batch)
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        key = jax.random.fold_in(key, lax.axis_index(DATA))
        params_v = jax.tree.map(_varying, state.params)
        if opts.accumulate_steps == 1:
            grads, model_state, sums = self._local_grads(params_v, state.model_state, batch, key)
        else:
            grads, model_state, sums = self._accumulate(params_v, state.model_state, batch, key)

        # The one all-reduce: gradients, loss/metric totals, counts and any
        # model state still varying, summed together (XLA emits one op; across CPU
        # processes `fused_psum` makes it one buffer per dtype, so one pass of the ring).
        synced, varying_state, unflatten_state = _split_varying(model_state)
        wire = opts.reduce_dtype
        grads_wire = grads if wire is None else jax.tree.map(lambda g: g.astype(wire), grads)
        grads_sum, sums, synced_sum = self._psum((grads_wire, sums, varying_state), DATA)
        model_state = unflatten_state(synced, [x / self.num_devices for x in synced_sum])

        return self._apply(state, grads_sum, sums, model_state)

    def _apply(self, state: state_lib.TrainState, grads_sum, sums, model_state):
        """The optimizer update from the all-reduced sums, identical on every replica."""
        opts = self.options
        loss_w, examples, aux = sums
        loss = reduce.safe_divide(loss_w.total, loss_w.weight)
        scale = 1.0 / jnp.where(loss_w.weight > 0, loss_w.weight, 1.0)
        metrics = {"loss": loss, "examples": examples}
        if opts.nonfinite != "ignore" or opts.clip_grad_norm is not None:
            # The norm of the mean gradient, from the sums: the mean itself is
            # only formed inside the update, where XLA fuses it into the optimizer.
            metrics["grad_norm"] = grad_norm = optax.tree.norm(grads_sum) * scale
        if opts.clip_grad_norm is not None:
            scale = scale * jnp.where(grad_norm > opts.clip_grad_norm, opts.clip_grad_norm / grad_norm, 1.0)

        def update(operands):
            grads_sum, params, opt_state, model_state, _ = operands
            grads = jax.tree.map(lambda s, p: (s.astype(jnp.float32) * scale).astype(p.dtype), grads_sum, params)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, model_state

        def skip(operands):
            _, params, opt_state, _, old_model_state = operands
            return params, opt_state, old_model_state

        operands = (grads_sum, state.params, state.opt_state, model_state, state.model_state)
        if opts.nonfinite == "ignore":
            params, opt_state, model_state = update(operands)
        else:
            # A branch, not a select: the common path reads each buffer once.
            finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
            metrics["nonfinite"] = (~finite).astype(jnp.float32)
            params, opt_state, model_state = lax.cond(finite, update, skip, operands)
        _check_metric_names(aux, metrics)
        metrics.update({k: reduce.safe_divide(w.total, w.weight) for k, w in aux.items()})
        return (state.step + 1, params, opt_state, model_state), self._pack("step", metrics)

    def _pack(self, program: str, metrics: dict) -> jax.Array:
        """Records the metric names (at trace time) and stacks the values."""
        self._names[program] = tuple(metrics)
        return jnp.stack([jnp.asarray(v, jnp.float32) for v in metrics.values()])

    def _local_grads(self, params_v, model_state, batch, key):
        """Local gradient of the loss *total* and the local sums, all varying."""
        count = reduce.example_count(batch, _leading_size(batch))

        def objective(params):
            loss, (new_model_state, aux) = _unpack_loss(self.loss_fn(params, model_state, batch, key))
            loss_w = reduce.as_weighted(loss, count, "The loss returned by `loss_fn`")
            aux_w = {k: reduce.as_weighted(v, count, f"Metric {k!r} returned by `loss_fn`") for k, v in aux.items()}
            return loss_w.total, (loss_w, new_model_state, aux_w)

        (_, (loss_w, new_model_state, aux_w)), grads = jax.value_and_grad(objective, has_aux=True)(params_v)
        sums = (loss_w, count, aux_w)
        return grads, new_model_state, jax.tree.map(_varying, sums)

    def _accumulate(self, params_v, model_state, batch, key):
        """Sums local gradients over micro-batches in a scan: no collective inside."""
        k = self.options.accumulate_steps
        micro = jax.tree.map(lambda x: x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)
        first = jax.tree.map(lambda x: x[0], micro)
        model_state = jax.tree.map(_varying, model_state)
        shapes = jax.eval_shape(self._local_grads, params_v, model_state, first, key)
        zeros = jax.tree.map(lambda s: _varying(jnp.zeros(s.shape, s.dtype)), (shapes[0], shapes[2]))

        def body(carry, xs):
            grads_acc, ms, sums_acc = carry
            mb, i = xs
            g, ms, s = self._local_grads(params_v, ms, mb, jax.random.fold_in(key, i))
            add = functools.partial(jax.tree.map, jnp.add)
            return (add(grads_acc, g), jax.tree.map(_varying, ms), add(sums_acc, s)), None

        init = (zeros[0], model_state, zeros[1])
        (grads, model_state, sums), _ = lax.scan(body, init, (micro, jnp.arange(k)))
        return grads, model_state, sums

    def _local_eval(self, train: _Train, rng: jax.Array, batch):
        state = state_lib.TrainState(*train, rng)
        batch = _unpacked(batch)
        count = reduce.example_count(batch, _leading_size(batch))
        if self.eval_fn is None:
            key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), lax.axis_index(DATA))
            loss, (_, aux) = _unpack_loss(self.loss_fn(state.params, state.model_state, batch, key))
            metrics = {"loss": loss, **aux}
        else:
            metrics = self.eval_fn(state.params, state.model_state, batch)
        if not isinstance(metrics, dict):
            raise TypeError(f"`eval_fn` must return a dict of scalars, got {type(metrics).__name__}.")
        sums = {k: reduce.as_weighted(v, count, f"Metric {k!r}") for k, v in metrics.items()}
        sums, examples = self._psum((jax.tree.map(_varying, sums), _varying(count)), DATA)
        metrics = {k: reduce.safe_divide(w.total, w.weight) for k, w in sums.items()}
        _check_metric_names(metrics, {"examples": examples})
        packed = self._pack("eval", {**metrics, "examples": examples})
        # The weights follow the values, so that `evaluate` can combine batches exactly.
        return jnp.concatenate([packed, jnp.stack([w.weight for w in sums.values()])])


# --------------------------------------------------------------- helpers


def _varying(x):
    """``x`` cast to varying over ``"data"`` (no-op when it already is)."""
    return x if DATA in jax_internals.varying_axes(x) else lax.pcast(x, DATA, to="varying")


def _split_varying(tree):
    """Splits a pytree's leaves into (all leaves, varying float leaves, rebuild)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [x for _, x in with_paths]
    idx = []
    for i, (path, x) in enumerate(with_paths):
        if DATA not in jax_internals.varying_axes(x):
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


def _unpacked(batch):
    """A ``PackedBatch`` (from ``jddp.data.DataLoader``) as its dict of arrays."""
    return packing.unpack(batch.data, batch.layout) if isinstance(batch, packing.PackedBatch) else batch


def _check_metric_names(user: dict, builtin: dict) -> None:
    clash = sorted(set(user) & set(builtin))
    if clash:
        raise ValueError(f"Metric names {clash} are reserved by jddp ({sorted(builtin)}); rename them.")


def _unpack_loss(out):
    try:
        loss, (model_state, metrics) = out
    except (TypeError, ValueError):
        raise TypeError(MSG_LOSS_OUTPUT.format(got=_describe(out))) from None
    if not isinstance(metrics, dict):
        raise TypeError(MSG_LOSS_OUTPUT.format(got=f"metrics of type {type(metrics).__name__}"))
    return loss, (model_state, metrics)


def _describe(x) -> str:
    if isinstance(x, tuple):
        return f"a tuple of {len(x)}"
    return f"{type(x).__name__} {getattr(x, 'shape', '')}".strip()


def _leading_size(batch) -> int:
    return jax.tree.leaves(batch)[0].shape[0]


def _host_copy(tree, what: str):
    """A NumPy copy of every leaf, or ``TypeError`` naming the first non-array leaf."""

    def copy(path, x):
        if not isinstance(x, jax.Array | np.ndarray | np.generic):
            raise TypeError(
                f"Every leaf of `{what}` must be an array, but {what}{jax.tree_util.keystr(path)} "
                f"is {type(x).__name__} ({x!r:.60}). Convert it with `jnp.asarray` or keep it "
                "out of the pytree (in the model or a closure)."
            )
        return np.array(jax.device_get(x), copy=True)

    return jax.tree_util.tree_map_with_path(copy, tree)


def _key_data(rng) -> np.ndarray:
    if isinstance(rng, int) and not isinstance(rng, bool):
        rng = jax.random.key(rng)
    if not isinstance(rng, jax.Array | np.ndarray):
        raise TypeError(f"`rng` must be a JAX PRNG key or an int seed, got {type(rng).__name__}.")
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    data = np.array(jax.device_get(rng), copy=True)
    if data.dtype != np.uint32 or data.shape != (2,):
        raise ValueError(
            f"`rng` must be a threefry key (uint32[2] key data), got dtype={data.dtype}, shape={data.shape}."
        )
    return data
