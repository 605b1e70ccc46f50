"""`DataParallel`: DDP's training step as one ``jit(shard_map(...))`` program.

About 480 lines, over the ~450 of the style guide, because the class docstring is the engine's manual (110 lines:
every option, with PyTorch's name for it) and its public methods are the API users call; what they call into is in
modules of their own: the checks (``checks``), the programs (``programs``, ``step``, ``zero``), the transport
(``transport``), the lowering for another platform (``lowering``), the collectives' report (``comm``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from jddp import runtime
from jddp import typing as jt
from jddp.engine import ahead, checks, comm, loss_scale, lowering, programs, replicas, zero
from jddp.engine import metrics as metrics_lib
from jddp.engine import step as step_lib
from jddp.engine import transport as transport_lib
from jddp.runtime import dispatch, distributed, first_run, progress, standby, watchdog
from jddp.runtime import mesh as mesh_lib
from jddp.runtime import state as state_lib

DATA = runtime.DATA_AXIS


class NonFiniteError(FloatingPointError):
    """A step produced a non-finite loss or gradient (``nonfinite="raise"``).

    The update was not applied; ``state`` is the state after the skipped step,
    so a caller can checkpoint it or lower the learning rate and go on.
    """

    def __init__(self, message: str, state: state_lib.TrainState):
        super().__init__(message)
        self.state = state


def _check_functions(loss_fn: Any, optimizer: Any, eval_fn: Any) -> None:
    """``TypeError`` unless ``loss_fn`` (and ``eval_fn``, when given) is callable and ``optimizer`` is optax's."""
    if not callable(loss_fn):
        raise TypeError(f"`loss_fn` must be callable, got {type(loss_fn).__name__}.")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"`optimizer` must be an optax.GradientTransformation, got {type(optimizer).__name__}.")
    if eval_fn is not None and not callable(eval_fn):
        raise TypeError(
            f"`eval_fn` must be a function (params, model_state, batch) -> metrics, or None, got "
            f"{type(eval_fn).__name__}."
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
        15 ms per step). Within one process, ``None`` packs unless a leaf is
        over 1 MiB: packing is faster there for small models (1.6 against 2.7 ms
        per step at 8 devices), but 2.5x slower when a large leaf shares the
        all-reduce with the packed buffer (``jddp.engine.fused`` says why it was
        once 17x slower everywhere, and what remains).
      shard_optimizer: ZeRO-1 (PyTorch's ``ZeroRedundancyOptimizer``): each
        device keeps ``1/N`` of the optimizer state; gradients are
        reduce-scattered instead of all-reduced, each device updates its slice
        and the new parameters are all-gathered (``jddp.engine.zero``; how
        leaves are split and padded: ``jddp.runtime.layout``). The training is
        the replicated engine's to float round-off, with the same options;
        checkpoints restore across device counts and engines.
      transport: how the processes sum: ``"xla"`` (XLA's own collectives;
        gloo across processes on CPU) or ``"mpi"`` (``MPI_Allreduce`` through
        mpi4jax, the ``jddp[mpi]`` extra; one device per process, processes
        started by MPI's launcher: ``jddp.engine.mpi``). ``None``:
        ``$JDDP_TRANSPORT`` (set by ``jddp launch --transport``), else ``"xla"``.
      rng: how ``loss_fn``'s ``rng`` is made on each device. ``"example"``:
        the same key on every device (the seed and the step folded in), and
        every draw whose leading axis is the batch's (dropout masks, noise,
        ``jax.random.split(rng, rows)``) is the one the example would get on
        one device, whatever the number of devices or processes
        (``jddp.engine.rng``). ``"device"``: the classic key per device
        (``axis_index`` folded in), cheaper by the random bits of the other
        devices' rows, but the training then depends on the device layout.
      grad_hook: what PyTorch users write between ``backward()`` and
        ``optimizer.step()``: ``grad_hook(grads, params) -> grads`` or
        ``(grads, metrics)``, called inside the step with the averaged (and
        clipped) gradient, identical on every replica; the gradients it
        returns feed the optimizer, and its scalar metrics join the step's.
        ``grad_norm`` reads the gradient before it; the non-finite guard reads
        both, so a hook that returns a non-finite gradient skips the step. What
        it returns must keep the tree, shapes and dtypes it got
        (``jddp.engine.contracts``).
      local_metrics: also report each device's own loss and gradient norm
        (means over its real examples) as ``local_loss/<i>`` and
        ``local_grad_norm/<i>`` for device ``i``: carried in the one
        all-reduce (2N scalars), for debugging a device whose data differs.
      compute_dtype: mixed precision (``torch.autocast``): the forward and
        backward pass run with the float params and batch arrays cast to this
        dtype (``jnp.bfloat16``); params, gradients and optimizer state stay
        in the params' dtype. ``jnp.float16`` adds dynamic loss scaling
        (``GradScaler``: ``jddp.engine.loss_scale``; the scale is in the
        optimizer state and in ``metrics["loss_scale"]``). ``None`` computes in
        the params' dtype.

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
        shard_optimizer: bool = False,
        transport: Literal["xla", "mpi"] | None = None,
        rng: Literal["example", "device"] = "example",
        grad_hook: Callable | None = None,
        local_metrics: bool = False,
        compute_dtype: Any = None,
    ):
        distributed.check_joined()
        _check_functions(loss_fn, optimizer, eval_fn)
        mesh_lib.check_mesh("mesh", mesh)
        transport_lib.check_transport(transport)
        self.options = checks.Options(
            accumulate_steps, reduce_dtype, clip_grad_norm, nonfinite, donate, max_inflight, fuse_allreduce,
            shard_optimizer, rng, grad_hook, local_metrics, compute_dtype,
        )  # fmt: skip
        if self.options.loss_scaled:  # float16 compute: the loss scale lives in the optimizer state
            optimizer = loss_scale.with_loss_scale(optimizer)
        self.loss_fn, self.optimizer, self.eval_fn, self.mesh = loss_fn, optimizer, eval_fn, mesh
        self.num_devices = mesh.shape[DATA]
        psum, fuse_allreduce, self.transport = transport_lib.psum_of(
            mesh,
            fuse_allreduce=fuse_allreduce,
            transport=transport,
            shard_optimizer=shard_optimizer,
            num_devices=self.num_devices,
        )
        self._rep = runtime.replicated(mesh)
        self._batch = runtime.batch_sharding(mesh)
        self._checked: tuple | None = None
        self._device = step_lib.DeviceStep(
            loss_fn, optimizer, eval_fn, self.options, self.num_devices, psum, fuse=fuse_allreduce
        )
        self._programs = programs.Programs(
            self._device, mesh, optimizer, self.options, rep=self._rep, batch=self._batch
        )
        self._step = self._programs.step  # the replicated step program

    def _args(self, state: state_lib.TrainState, batch):
        return (state.step, state.params, state.opt_state, state.model_state), state.rng, batch

    def _eval_args(self, state: state_lib.TrainState, batch):
        return (state.step, state.params, None, state.model_state), state.rng, batch  # no optimizer state to move

    def _program(self, state: state_lib.TrainState):
        """The step program for ``state``'s optimizer layout, checked against this engine's the first time."""
        return self._programs.for_state(state)

    # ----------------------------------------------------------------- init

    @progress.collective_call("DataParallel.init")
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
        params = checks.host_copy(params, "params")
        if not jax.tree.leaves(params):
            raise ValueError(
                f"`params` holds no arrays, got params={params!r:.60}; pass the model's trainable parameters (a "
                "pytree of float arrays)."
            )
        checks.check_trainable(params)
        model_state = checks.host_copy({} if model_state is None else model_state, "model_state")
        key = checks.key_data(rng)
        dispatch.DISPATCHER.drain()
        first_run.meet_once(first_run.GLOBAL_DEVICES, "DataParallel.init")  # before the group's first collective
        params, model_state, key = replicas.broadcast_from_process_0((params, model_state, key))
        put = functools.partial(replicas.put_replicated, sharding=self._rep)
        params = jax.tree.map(put, params)
        layout = None
        if self.options.shard_optimizer:
            layout = zero.opt_layouts(self.optimizer, params, self.num_devices)
            treedef = jax.tree.structure(jax.eval_shape(self.optimizer.init, params))
            opt_state = zero.init_program(self.optimizer, layout, treedef, self.mesh)(params)
        else:
            opt_state = jax.jit(self.optimizer.init, out_shardings=self._rep)(params)
        state = state_lib.TrainState(
            step=put(np.zeros((), np.int32)),
            params=params,
            opt_state=opt_state,
            model_state=jax.tree.map(put, model_state),
            rng=put(key),
            opt_layout=layout,
        )
        replicas.assert_same_on_every_process(state, "state")
        ahead.remember(self, state)  # a standby process compiles the step for it before it stands by
        return state

    # ----------------------------------------------------------------- step

    @progress.collective_call("DataParallel.step", eager=False)  # every step: published by the watchdog
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
        standby.wait()  # a standby process of the next attempt (jddp launch) never trains before it is woken
        checks.check_call(self, state, batch)
        program = self._program(state)
        if step_lib.leading_size(batch) == 0:
            return self._empty_step(state)
        dispatch.DISPATCHER.before(program, self.options.max_inflight)
        number = progress.PROGRESS.step
        first = dispatch.DISPATCHER.first_call(program)
        with (
            progress.phase("compile" if first else "step"),
            watchdog.waiting(),  # on CPU the call may run the program, and its collectives, before it returns
            checks.user_code(
                self.loss_fn, "DataParallel.step", batch, state.params, self.num_devices, self.options.accumulate_steps
            ),
        ):
            args = self._args(state, batch)  # a first call compiles, meets every process, then runs (first_run)
            outputs = dispatch.DISPATCHER.call(program, args, first=first, label="DataParallel.step")
            (step, params, opt_state, model_state), packed = outputs
        if self.options.donate:  # read as donated even where a NumPy view kept JAX from donating the counter
            state_lib.mark_donated(state)
        dispatch.DISPATCHER.after(packed, f"train step {number}")
        progress.heartbeat(number + 1)
        state = state_lib.unchecked_state(step, params, opt_state, model_state, state.rng, state.opt_layout)
        metrics = metrics_lib.Metrics(self._device.names["step"], packed)
        if self.options.nonfinite == "raise" and metrics["nonfinite"]:
            step = int(state.step) - 1
            raise NonFiniteError(
                f"Non-finite loss or gradient at step={step} (loss={float(metrics['loss'])}, "
                f"grad_norm={float(metrics['grad_norm'])}); the update was skipped. Use "
                "`nonfinite='skip'` to go on, or lower the learning rate.",
                state,
            )
        return state, metrics

    def _empty_step(self, state: state_lib.TrainState) -> tuple[state_lib.TrainState, metrics_lib.Metrics]:
        """A batch of 0 examples: no program runs (a loss over nothing cannot be traced); the state is unchanged
        but for its step counter, as for a batch of padding, and every metric is 0, ``examples`` too."""
        names = self._device.names.get("step", ("loss", "examples", "grad_norm", "nonfinite"))
        if self.options.nonfinite == "ignore" and "step" not in self._device.names:
            names = ("loss", "examples") if self.options.clip_grad_norm is None else ("loss", "examples", "grad_norm")
        packed = jax.device_put(np.zeros(len(names), np.float32), self._rep)
        step = jax.jit(lambda s: s + 1, out_shardings=self._rep)(state.step)
        new_state = state.replace(step=step)
        progress.heartbeat(progress.PROGRESS.step + 1)
        return new_state, metrics_lib.Metrics(names, packed)

    @progress.collective_call("DataParallel.eval_step")
    def eval_step(self, state: state_lib.TrainState, batch: jt.Batch) -> metrics_lib.Metrics:
        """Exact global means of the evaluation metrics over the batch's real examples.

        Args:
          state: a ``TrainState`` (not donated).
          batch: as for ``step``; pad the last batch and mask the padding.

        Returns:
          ``Metrics`` (names to floats), plus ``examples``, the real examples counted.
        """
        return self._eval_step(state, batch, "batch")

    def _eval_step(self, state: state_lib.TrainState, batch: jt.Batch, what: str) -> metrics_lib.Metrics:
        checks.check_call(self, state, batch, what, accumulated=False)
        if step_lib.leading_size(batch) == 0:  # nothing to evaluate: every mean 0 with weight 0
            names = self._device.names.get("eval", ("loss", "examples"))
            packed = jax.device_put(np.zeros(2 * len(names) - 1, np.float32), self._rep)
            return metrics_lib.Metrics(names, packed)
        dispatch.DISPATCHER.before(self._programs.eval, self.options.max_inflight)
        fn = self.eval_fn or self.loss_fn
        first = dispatch.DISPATCHER.first_call(self._programs.eval)
        with (
            progress.phase("compile" if first else "eval"),
            watchdog.waiting(),
            checks.user_code(fn, "DataParallel.eval_step", batch, state.params, self.num_devices),
        ):
            args = self._eval_args(state, batch)
            packed = dispatch.DISPATCHER.call(self._programs.eval, args, first=first, label="DataParallel.eval_step")
        dispatch.DISPATCHER.after(packed, "eval step")
        progress.heartbeat()
        return metrics_lib.Metrics(self._device.names["eval"], packed)

    @progress.collective_call("DataParallel.evaluate")
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
        if isinstance(batches, Mapping | str | bytes) or not isinstance(batches, Iterable):
            one = " (one batch: pass [batch])" if isinstance(batches, Mapping) else ""
            raise TypeError(
                f"`batches` must be an iterable of batches (a DataLoader, a list of dicts of arrays), got "
                f"{type(batches).__name__}{one}."
            )
        checks.check_state(self, state)
        sampler = getattr(batches, "sampler", None)
        if (
            sampler is not None
            and getattr(sampler, "drop_last", False)
            and sampler.dataset_size % sampler.global_batch_size
        ):
            raise ValueError(
                f"`evaluate` over a DataLoader with drop_last=True would skip the last "
                f"{sampler.dataset_size % sampler.global_batch_size} of {sampler.dataset_size} examples. Build the "
                "evaluation loader with drop_last=False (and shuffle=False): the last batch is padded and the "
                "padding masked, so every example counts once."
            )
        totals: dict[str, float] = {}
        weights: dict[str, float] = {}
        examples = 0.0
        for i, batch in enumerate(batches):
            m = self._eval_step(state, batch, f"batches[{i}]")
            for name, weight in m.weights.items():
                totals[name] = totals.get(name, 0.0) + m[name] * weight
                weights[name] = weights.get(name, 0.0) + weight
            examples += m["examples"]
        means = {k: totals[k] / weights[k] if weights[k] else 0.0 for k in totals}
        return {**means, "examples": examples}

    def compile(self, state: state_lib.TrainState, batch: jt.Batch) -> jax.stages.Compiled:
        """Compiles the step for ``state`` and ``batch`` ahead of time, without running it or touching either.

        The program is kept where ``step`` finds it: the first ``step`` on arrays of the same shapes, dtypes and
        shardings (the state a checkpoint restores into ``state``, any batch of the same loader) runs without
        tracing or compiling. ``jddp.fit`` calls it in a standby process before its restore
        (``jddp.runtime.standby``). Not a collective: no process waits for another.

        Returns:
          the compiled step (``jax.stages.Compiled``: ``cost_analysis()``, ``as_text()``, ...).
        """
        checks.check_call(self, state, batch)
        return self._lowered(state, batch).compile()

    def _lowered(self, state: state_lib.TrainState, batch: jt.Batch) -> jax.stages.Lowered:
        return self._program(state).lower(*self._args(state, batch))

    def lower(
        self, state: state_lib.TrainState, batch: jt.Batch, *, platform: str | None = None, program: str = "step"
    ) -> jax.stages.Lowered:
        """The ``program`` (``"step"``, ``"eval"``, ``"replica_check"``) for ``state`` and ``batch``, lowered for
        ``platform`` (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``; default this machine's), which need not be
        present: JAX lowers for any platform without its device. Nothing runs; ``as_text()`` is the StableHLO.

        Raises:
          ValueError: for an unknown ``platform`` or ``program``, or a program holding an operation that exists
            only on another platform (a host callback, a CPU-only primitive), naming the platform.
        """
        checks.check_call(self, state, batch)
        platform = jax.default_backend() if platform is None else platform
        return lowering.lower(self, state, batch, platform=platform, program=program)

    def comm_report(
        self, state: state_lib.TrainState, batch: jt.Batch, *, platform: str | None = None
    ) -> comm.CommReport:
        """The collectives of the compiled step (op, operands, dtype, bytes), and in ``lowered`` as asked for.

        Compiling for the report does not run the step or touch ``state``. With ``platform`` (``"cuda"``,
        ``"rocm"``, ``"tpu"``) the step is lowered for that platform instead, with no device of it needed: the
        report then holds the lowered collectives, the custom calls, and in ``notes`` what would not run as well
        there (``CommReport.from_lowered``).
        """
        checks.check_call(self, state, batch)
        if platform is not None and platform != jax.default_backend():
            text = self.lower(state, batch, platform=platform).as_text()
            return comm.CommReport.from_lowered(text, platform=platform)
        lowered = self._lowered(state, batch)
        hlo = lowered.compile().as_text()
        if hlo is None:
            raise RuntimeError("The backend gives no compiled HLO text, so the step's collectives cannot be listed.")
        return comm.CommReport.from_hlo(hlo, reduce_dtype=self.options.reduce_dtype, lowered_text=lowered.as_text())

    @progress.collective_call("DataParallel.check_replicas")
    def check_replicas(self, state: state_lib.TrainState) -> None:
        """Raises ``ReplicaMismatchError`` naming the leaf, the devices and the processes where replicas of
        ``state`` differ (a 64-bit checksum of every copy, on its device; see ``jddp.engine.replicas``).

        A collective: call it on every process, at the same step (``jddp.fit`` does every
        ``replica_check_every`` steps and before each checkpoint).
        """
        checks.check_state(self, state)
        dispatch.DISPATCHER.drain()  # another program with collectives must not be in flight
        with watchdog.waiting():
            replicas.check_replicas(state, self.mesh)

    def assert_replicas_identical(self, state: state_lib.TrainState) -> None:
        """``check_replicas``, kept under its earlier name (``ReplicaMismatchError`` is an ``AssertionError``)."""
        self.check_replicas(state)
