"""Bring your own train step: a script's own step function run data-parallel, its gradients averaged exactly.

Most JAX scripts own their train step: Flax's ``TrainState.apply_gradients``, Equinox's
``filter_value_and_grad`` + ``optax.update``, a plain ``jax.value_and_grad``. Horovod's answer for such scripts
was to wrap the optimizer, not to rewrite the loop; this module is that answer for JAX, in two pieces:

* ``average_gradients()``, an optax transformation put first in the script's chain
  (``optax.chain(jddp.average_gradients(), optax.adamw(...))``): the gradient each device computed on its slice
  becomes the exact mean over the global batch's real examples (weighted by each device's count of them, as
  ``DataParallel``'s step is), in one all-reduce. ``global_mean(tree)`` is the same average for code without optax.
* ``data_parallel(step, batch_argnums=...)``, which replaces the script's ``jax.jit`` (or ``eqx.filter_jit``):
  the batch arguments are split over the mesh's ``"data"`` axis, every other argument is replicated, and the
  script's function runs once per device under ``jax.jit(shard_map(...))``.

What it keeps of ``DataParallel``'s guarantees, and where it cannot (``docs/guides/porting.md``):

* **Exact mean, one all-reduce, identical replicas**: the update is computed on every device from the same
  averaged gradient, so the replicas of the returned state stay bit-identical (``check_replicas``). Every output is
  checked at trace time to be the same on every device (the jaxpr analysis of ``jddp.engine.varying``): an output
  that depends on the device's slice without passing through an average (a metric, batch statistics, parameters
  updated from a gradient nobody averaged) is refused with its path, before anything runs.
* **Layout-invariant randomness** (``rng="example"``): a draw shaped like the batch from a key the step was given
  (dropout) is made for the whole global batch and sliced, so each example sees the numbers it sees on one device.
* **What it cannot know**: whether the loss is a mean over the slice's real examples. The weight of each device is
  its count of real examples (``batch["mask"]``'s sum, else its rows), which is right for a loss that averages over
  the real examples of its slice (``jddp.masked_mean``) and for every unpadded batch. A metric returned as a sum is
  the user's to ``jax.lax.psum(x, "data")``; a mean is ``global_mean``'s. Skipping a step without real examples,
  the non-finite guard, clipping after the average and loss scaling are ``DataParallel``'s: here they are the
  script's own optax chain's (put ``optax.clip_by_global_norm`` after ``average_gradients``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jddp import runtime, validate
from jddp.engine import ahead, checks, comm, reduce, replicas, transport, varying
from jddp.engine import rng as rng_lib
from jddp.engine import step as step_lib
from jddp.runtime import dispatch, distributed, progress, standby, watchdog
from jddp.runtime import mesh as mesh_lib
from jddp.runtime import state as state_lib

DATA = runtime.DATA_AXIS
_ARRAYS = (jax.Array, np.ndarray, np.generic)
_LOCAL = threading.local()


@dataclasses.dataclass
class _Shard:
    """What ``global_mean`` needs while a ``data_parallel`` step is traced on one device."""

    weight: jax.Array  # this device's real examples over its rows (0..1), float32
    psum: Callable
    name: str  # the step's name, for errors


def _current() -> _Shard | None:
    stack = getattr(_LOCAL, "stack", ())
    return stack[-1] if stack else None


@contextlib.contextmanager
def _entered(shard: _Shard):
    _LOCAL.stack = (*getattr(_LOCAL, "stack", ()), shard)
    try:
        yield shard
    finally:
        _LOCAL.stack = _LOCAL.stack[:-1]


def _axis_bound() -> bool:
    try:
        lax.axis_size(DATA)
    except NameError:
        return False
    return True


def global_mean(tree):
    """The exact mean over the global batch of ``tree``, a pytree of per-device means (float arrays), inside a
    ``data_parallel`` step: each device's value weighted by its count of real examples, summed in one all-reduce,
    divided once. The same on every device. Outside any ``"data"`` axis (the step run by plain ``jax.jit`` on one
    device, as a reference) it returns ``tree`` unchanged: one device holds the whole batch.

    Raises:
      TypeError: for a leaf that is not a float array (a count or a sum of integers is ``jax.lax.psum(x, "data")``).
      RuntimeError: inside a ``"data"`` axis of the user's own (``shard_map``, ``pmap``), where jddp does not know
        each device's weight.
    """
    shard = _current()
    name = shard.name if shard is not None else "the step"
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not leaves:
        raise ValueError(f"`tree` must be a pytree of float arrays (per-device means), got tree={tree!r:.60}.")
    for path, x in leaves:
        if not (isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(x.dtype, jnp.inexact)):
            dtype = getattr(x, "dtype", type(x).__name__)
            raise TypeError(
                f"jddp.global_mean averages float arrays (per-device means), but `tree` leaf "
                f"{jax.tree_util.keystr(path)!r} in {name} is {dtype}. For a count or a sum use "
                "jax.lax.psum(x, 'data'); leave non-trainable leaves out of the tree you average (optax.masked, "
                "or average only the gradients)."
            )
    if shard is None:
        if _axis_bound():
            raise RuntimeError(
                "jddp.global_mean (and jddp.average_gradients) was called inside a 'data' axis that jddp did not "
                "set up (your own shard_map or pmap): it needs each device's count of real examples. Run the step "
                "with jddp.data_parallel, or average with jax.lax.pmean yourself."
            )
        return tree
    values = [x for _, x in leaves]
    weight = shard.weight
    summed, total = shard.psum(([x * weight.astype(x.dtype) for x in values], weight), DATA)
    means = [reduce.safe_divide(s, total.astype(jnp.result_type(s.dtype, jnp.float32))).astype(s.dtype) for s in summed]
    return jax.tree.unflatten(treedef, means)


def average_gradients() -> optax.GradientTransformation:
    """An optax transformation that makes each device's gradient the exact mean over the global batch
    (``global_mean``): put it first in the chain, before clipping, weight decay and the optimizer, so that they see
    the averaged gradient: ``optax.chain(jddp.average_gradients(), optax.adamw(1e-3))``. Horovod's
    ``DistributedOptimizer``, for optax. No state; outside ``data_parallel`` it passes gradients through."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        return global_mean(updates), state

    return optax.GradientTransformation(init, update)


@dataclasses.dataclass
class _Call:
    """One call's arguments, split: array leaves by kind (donated state, kept state, batch) and the rest static."""

    treedef: Any
    kinds: tuple[str, ...]  # per leaf: "donate", "state", "batch" or "static"
    statics: tuple  # the static leaves, in order
    donated: list
    kept: list
    batch: list

    def signature(self) -> tuple:
        avals = tuple((np.shape(x), str(getattr(x, "dtype", None))) for x in (*self.donated, *self.kept, *self.batch))
        return (self.treedef, self.kinds, self.statics, avals)


@dataclasses.dataclass
class _Program:
    jitted: Any
    outputs: dict  # filled when traced: the output treedef and its static leaves


class DataParallelStep:
    """A user's step function run data-parallel: see ``data_parallel``."""

    def __init__(
        self,
        fn: Callable,
        *,
        batch_argnums: int | Sequence[int],
        mesh: Mesh | None = None,
        donate_argnums: int | Sequence[int] = (),
        rng: str | None = "example",
        max_inflight: int = 2,
    ):
        distributed.check_joined()
        if not callable(fn):
            raise TypeError(f"`fn` must be the step function to run data-parallel, got {type(fn).__name__}.")
        self.batch_argnums = _argnums("batch_argnums", batch_argnums, empty=False)
        self.donate_argnums = _argnums("donate_argnums", donate_argnums, empty=True)
        both = sorted(set(self.batch_argnums) & set(self.donate_argnums))
        if both:
            raise ValueError(
                f"Argument(s) {both} are in both `batch_argnums` and `donate_argnums`: a batch is split over the "
                "devices and never donated. Donate the state arguments only."
            )
        if rng not in ("example", None):
            raise ValueError(
                f"`rng` must be 'example' (draws shaped like the batch made for the global batch, as on one device) "
                f"or None (draws as the step makes them), got {rng!r}."
            )
        validate.check_int("max_inflight", max_inflight, minimum=1)
        if mesh is None:
            mesh = runtime.data_mesh()
        mesh_lib.check_mesh("mesh", mesh)
        self.fn, self.mesh, self.rng, self.max_inflight = fn, mesh, rng, max_inflight
        self.num_devices = mesh.shape[DATA]
        self.name = getattr(fn, "__qualname__", type(fn).__name__)
        self._psum = transport.psum_of(
            mesh, fuse_allreduce=None, transport=None, shard_optimizer=False, num_devices=self.num_devices
        )[0]
        self._rep, self._batch = runtime.replicated(mesh), runtime.batch_sharding(mesh)
        self._programs: dict[tuple, _Program] = {}
        self._masks_checked: set = set()
        functools.update_wrapper(self, fn)
        ahead.remember_step(self)  # a standby process compiles it before it stands by, where its arguments are known

    # ----------------------------------------------------------------- calling

    def __call__(self, *args):
        standby.wait()  # a standby process of the next attempt (jddp launch) never trains before it is woken
        call = self._split(args)
        program = self._program(call)
        dispatch.DISPATCHER.before(program.jitted, self.max_inflight)
        number = progress.PROGRESS.step
        batch_tree = [args[i] for i in self.batch_argnums]
        first = dispatch.DISPATCHER.first_call(program.jitted)
        with (
            progress.phase("compile" if first else "step"),
            watchdog.waiting(),
            checks.user_code(self.fn, f"jddp.data_parallel({self.name})", batch_tree, (), self.num_devices),
        ):
            operands = (call.donated, call.kept, call.batch)  # a first call compiles, meets the group, then runs
            label = f"jddp.data_parallel({self.name})"
            outs, done = dispatch.DISPATCHER.call(program.jitted, operands, first=first, label=label)
        dispatch.DISPATCHER.after(done, f"{self.name} call {number}")
        progress.heartbeat(number + 1)
        return _rebuild_outputs(program.outputs, outs)

    def lower(self, *args, platform: str | None = None) -> jax.stages.Lowered:
        """The step's device program for ``args``, lowered for ``platform`` (``"cpu"``, ``"cuda"``, ``"rocm"``,
        ``"tpu"``; default this machine's), which need not be present. Nothing runs and nothing is donated."""
        call = self._split(args, place=platform is None)
        program = self._program(call)
        operands = (call.donated, call.kept, call.batch)
        if platform is None:
            return program.jitted.lower(*operands)
        return comm.lower_for(program.jitted, operands, platform)

    def comm_report(self, *args, platform: str | None = None) -> comm.CommReport:
        """The collectives of the compiled step for ``args`` (op, operands, dtype, bytes); with ``platform``, those
        of the program lowered for it (``CommReport.from_lowered``). Nothing runs."""
        if platform is not None and platform != jax.default_backend():
            return comm.CommReport.from_lowered(self.lower(*args, platform=platform).as_text(), platform=platform)
        lowered = self.lower(*args)
        return comm.CommReport.from_hlo(lowered.compile().as_text() or "", lowered_text=lowered.as_text())

    @progress.collective_call("data_parallel.check_replicas")
    def check_replicas(self, tree) -> None:
        """Raises ``ReplicaMismatchError`` naming the leaf and the devices where replicas of ``tree`` (a state the
        step returned) differ. A collective: call it on every process at the same point."""
        arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
        dispatch.DISPATCHER.drain()
        with watchdog.waiting():
            replicas.check_replicas(arrays, self.mesh)

    # ----------------------------------------------------------------- arguments

    def _split(self, args: tuple, *, place: bool = True) -> _Call:
        if len(args) <= max(self.batch_argnums):
            raise TypeError(
                f"{self.name} was called with {len(args)} positional argument(s), but batch_argnums="
                f"{self.batch_argnums} names argument {max(self.batch_argnums)}. Pass the batch positionally."
            )
        leaves, treedef = jax.tree_util.tree_flatten_with_path(args)
        kinds, statics, donated, kept, batch = [], [], [], [], []
        equinox = {i for i, arg in enumerate(args) if state_lib.holds_equinox_module(arg)}
        for path, x in leaves:
            argnum = path[0].idx  # pyright: ignore[reportAttributeAccessIssue]
            where = f"args[{argnum}]{jax.tree_util.keystr(path[1:])}"
            state_number = argnum not in self.batch_argnums and argnum not in equinox
            if state_number and isinstance(x, (bool, int, float, complex)):
                x = jnp.asarray(x)  # jax.jit's rule: a Python number is traced (Flax's TrainState.step starts at 0)
            if argnum in self.batch_argnums:
                if not isinstance(x, _ARRAYS):
                    raise TypeError(
                        f"Every leaf of a batch argument of {self.name} must be an array with the batch as its "
                        f"leading axis, but {where} is {type(x).__name__}. Keep it out of the batch (pass it as "
                        "another argument) or make it an array."
                    )
                kinds.append("batch")
                batch.append(x)
            elif isinstance(x, _ARRAYS) or (not place and isinstance(x, jax.ShapeDtypeStruct)):
                if isinstance(x, jax.Array) and x.is_deleted():
                    raise ValueError(
                        f"{where} is a deleted jax.Array: it was donated to an earlier call of {self.name} "
                        "(donate_argnums). Pass the value the step returned."
                    )
                kind = "donate" if argnum in self.donate_argnums else "state"
                kinds.append(kind)
                (donated if kind == "donate" else kept).append(x)
            else:
                try:
                    hash(x)
                except TypeError:
                    raise TypeError(
                        f"{where} of {self.name} is {type(x).__name__}, neither an array nor hashable: non-array "
                        "leaves are static (compiled into the step, as eqx.filter_jit does), so they must be "
                        "hashable. Make it an array, or a tuple instead of a list."
                    ) from None
                kinds.append("static")
                statics.append(x)
        self._check_batch([args[i] for i in self.batch_argnums], batch)
        if place:
            donated, kept = self._replicated(donated), self._replicated(kept)
            batch = [self._split_over_data(x) for x in batch]
        return _Call(treedef, tuple(kinds), tuple(statics), donated, kept, batch)

    def _check_batch(self, batch_args: list, leaves: list) -> None:
        local = self.num_devices // max(jax.process_count(), 1) if jax.process_count() > 1 else self.num_devices
        # The local part of a NumPy batch is split over this process's devices; a global jax.Array over them all.
        devices = self.num_devices if all(isinstance(x, jax.Array) for x in leaves) else local
        shim = types.SimpleNamespace(num_devices=devices, options=types.SimpleNamespace(accumulate_steps=1))
        for i, arg in zip(self.batch_argnums, batch_args, strict=True):
            what = f"args[{i}] of {self.name}"
            if jax.process_count() > 1 and not all(isinstance(x, jax.Array) for x in jax.tree.leaves(arg)):
                continue  # this process's NumPy part: make_array_from_process_local_data checks it when placed
            checks.check_batch(shim, arg, jax.tree.leaves(arg), what, 1)
            size = np.shape(jax.tree.leaves(arg)[0])[0]
            key = (i, size)
            checks.check_mask(arg, size, every_value=key not in self._masks_checked, what=what)
            self._masks_checked.add(key)
        sizes = {np.shape(x)[0] for x in leaves}
        if len(sizes) > 1:
            raise ValueError(
                f"The batch arguments {self.batch_argnums} of {self.name} have different leading (batch) sizes "
                f"{sorted(sizes)}: every batch leaf must hold the same examples along its first axis."
            )

    def _replicated(self, leaves: list) -> list:
        """Each state leaf held whole on every device: as it is when it already is (a state the step returned),
        else process 0's value placed on every device (as DDP's constructor broadcasts the model)."""
        out = []
        for x in leaves:
            if isinstance(x, jax.Array) and _same_sharding(x.sharding, self._rep, x.ndim):
                out.append(x)
            elif jax.process_count() == 1:
                out.append(jax.device_put(x, self._rep))
            else:
                out.append(_broadcast_placed(x, self._rep))
        return out

    def _split_over_data(self, x):
        if isinstance(x, jax.Array) and _same_sharding(x.sharding, self._batch, x.ndim):
            return x
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, self._batch)  # a global array of another layout: resharded
        if jax.process_count() == 1:
            return jax.device_put(x, self._batch)
        return jax.make_array_from_process_local_data(self._batch, np.asarray(x))

    # ----------------------------------------------------------------- programs

    def _program(self, call: _Call) -> _Program:
        key = call.signature()
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = self._build(call)
        return program

    def _build(self, call: _Call) -> _Program:
        outputs: dict = {}
        fn, name, num_devices, psum, rng = self.fn, self.name, self.num_devices, self._psum, self.rng
        batch_argnums = self.batch_argnums

        def user(donated, kept, batch):
            leaves = _merge(call.kinds, call.statics, donated, kept, batch)
            args = list(jax.tree.unflatten(call.treedef, leaves))
            for i in batch_argnums:
                args[i] = step_lib.unpacked(args[i])
            rows = step_lib.leading_size([args[i] for i in batch_argnums])
            weight = _weight([args[i] for i in batch_argnums], rows)
            with _entered(_Shard(weight, psum, name)):
                out = fn(*args)
            out_leaves, out_treedef = jax.tree_util.tree_flatten_with_path(out)
            is_array = [isinstance(x, jax.Array) for _, x in out_leaves]
            outputs["treedef"], outputs["is_array"] = out_treedef, is_array
            outputs["paths"] = [jax.tree_util.keystr(p) for p, _ in out_leaves]
            outputs["statics"] = [x for (_, x), a in zip(out_leaves, is_array, strict=True) if not a]
            return [x for (_, x), a in zip(out_leaves, is_array, strict=True) if a]

        def device(donated, kept, batch):
            rows = np.shape(batch[0])[0] if batch else 0
            traced_fn = rng_lib.per_example(user, rows, rows * num_devices, draws=rng == "example")
            outs, flags = varying.traced(traced_fn, (donated, kept, batch), (False, False, True))  # pyright: ignore
            arrays = [p for p, a in zip(outputs["paths"], outputs["is_array"], strict=True) if a]
            differ = [p or "(the output)" for p, f in zip(arrays, flags, strict=True) if f]
            if differ:
                raise ValueError(_differ_message(name, differ))
            return outs, jnp.zeros((), jnp.int32)

        mapped = jax.shard_map(
            device, mesh=self.mesh, in_specs=(P(), P(), P(DATA)), out_specs=(P(), P()), check_vma=False
        )
        donate = (0,) if call.donated else ()
        jitted = jax.jit(
            mapped,
            in_shardings=(self._rep, self._rep, self._batch),
            out_shardings=(self._rep, self._rep),
            donate_argnums=donate,
        )
        return _Program(jitted, outputs)


@overload
def data_parallel(
    fn: Callable,
    *,
    batch_argnums: int | Sequence[int],
    mesh: Mesh | None = None,
    donate_argnums: int | Sequence[int] = (),
    rng: str | None = "example",
    max_inflight: int = 2,
) -> DataParallelStep: ...


@overload
def data_parallel(
    fn: None = None,
    *,
    batch_argnums: int | Sequence[int],
    mesh: Mesh | None = None,
    donate_argnums: int | Sequence[int] = (),
    rng: str | None = "example",
    max_inflight: int = 2,
) -> Callable[[Callable], DataParallelStep]: ...


def data_parallel(
    fn: Callable | None = None,
    *,
    batch_argnums: int | Sequence[int],
    mesh: Mesh | None = None,
    donate_argnums: int | Sequence[int] = (),
    rng: str | None = "example",
    max_inflight: int = 2,
) -> DataParallelStep | Callable[[Callable], DataParallelStep]:
    """Runs a script's own step function data-parallel: ``jax.jit`` for a step that averages its gradients with
    ``jddp.average_gradients()`` (or ``jddp.global_mean``).

    ``fn(*args)`` runs once per device under ``jax.jit(shard_map(...))`` over ``mesh``'s ``"data"`` axis. The
    arguments in ``batch_argnums`` are batches: every leaf an array whose leading axis is the examples, split over
    the devices (a global ``jax.Array`` from ``jddp.data.DataLoader``, or NumPy: in a run of several processes,
    this process's part, as ``jax.make_array_from_process_local_data`` takes it). Every other array is state, held
    whole on every device (placed there at its first call, from process 0's value); a Python number is traced, as
    ``jax.jit`` traces it (Flax's ``TrainState.step`` starts as ``0``), except in an argument holding an Equinox
    module, where it is static as ``eqx.filter_jit`` makes it; every other leaf that is not an array (a function,
    a string) is static, compiled into the program. The outputs come back held whole on every device, static
    leaves as the step returned them.

    Usable as a decorator: ``@jddp.data_parallel(batch_argnums=1)``.

    Args:
      fn: the step, e.g. ``train_step(state, batch) -> (state, metrics)``.
      batch_argnums: the positions of the batch arguments (``1``; ``(1, 2)`` for ``make_step(model, x, y, opt)``).
      mesh: a mesh with a ``"data"`` axis; default ``jddp.data_mesh()``.
      donate_argnums: state arguments whose buffers the step may reuse for its outputs (as ``jax.jit``'s).
      rng: ``"example"``: a random draw shaped like the device's batch from a key argument (dropout) is made for
        the global batch and sliced, so each example sees the numbers it would see on one device, on any layout
        (``jddp.engine.rng``); ``None``: draws as the step makes them (each device the same numbers for its
        rows, unless the step folds in ``jax.lax.axis_index("data")``).
      max_inflight: calls dispatched ahead of the host before it waits for the oldest.

    Returns:
      a ``DataParallelStep``: call it as ``fn``; ``lower``, ``comm_report`` and ``check_replicas`` inspect it.

    Raises (at the first call of each shape, before anything runs):
      ValueError: an output that differs across devices (depends on the device's slice without an average),
        naming it; a batch the devices cannot split.
      TypeError: a batch leaf that is not an array; a static leaf that is not hashable.
    """
    make = functools.partial(
        DataParallelStep,
        batch_argnums=batch_argnums,
        mesh=mesh,
        donate_argnums=donate_argnums,
        rng=rng,
        max_inflight=max_inflight,
    )
    if fn is None:
        return make
    return make(fn)


# ----------------------------------------------------------------- helpers


def _argnums(name: str, value: Any, *, empty: bool) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(items, (tuple, list)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items
    ):
        raise TypeError(f"`{name}` must be a non-negative int or a tuple of them, got {value!r}.")
    if not items and not empty:
        raise ValueError(f"`{name}` must name at least one argument (the batch), got {value!r}.")
    if len(set(items)) != len(items):
        raise ValueError(f"`{name}` names an argument twice: {value!r}.")
    return tuple(sorted(items))


def _same_sharding(have, want, ndim: int) -> bool:
    return have == want or have.is_equivalent_to(want, ndim)


def _broadcast_placed(x, sharding) -> jax.Array:
    """``x`` from process 0 on every device of ``sharding`` (PRNG keys through their key data)."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        impl = jax.random.key_impl(x)
        data = replicas.broadcast_from_process_0(np.asarray(jax.random.key_data(x)))
        return jax.random.wrap_key_data(replicas.put_replicated(data, sharding), impl=impl)
    host = np.asarray(jax.device_get(x))
    return replicas.put_replicated(replicas.broadcast_from_process_0(host), sharding)


def _merge(kinds: tuple[str, ...], statics: tuple, donated: list, kept: list, batch: list) -> list:
    sources = {"donate": iter(donated), "state": iter(kept), "batch": iter(batch), "static": iter(statics)}
    return [next(sources[k]) for k in kinds]


def _weight(batch_args: list, rows: int) -> jax.Array:
    """This device's count of real examples over its rows: the top-level ``mask`` of the first batch argument
    holding one, else 1 (every row real)."""
    for arg in batch_args:
        mask = reduce.find_mask(arg)
        if mask is not None:
            return jnp.sum(mask.astype(jnp.float32)) / max(rows, 1)
    return jnp.ones((), jnp.float32)


def _rebuild_outputs(outputs: dict, arrays: list):
    arrays_it, statics_it = iter(arrays), iter(outputs["statics"])
    leaves = [next(arrays_it) if a else next(statics_it) for a in outputs["is_array"]]
    return jax.tree.unflatten(outputs["treedef"], leaves)


def _differ_message(name: str, paths: list[str]) -> str:
    shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    return (
        f"Output(s) {shown} of {name} differ across devices: each depends on its device's slice of the batch and "
        "passes through no average, so the devices would return different values. Average what the step "
        "returns: put jddp.average_gradients() first in the optax chain (parameters updated from an averaged "
        "gradient are the same everywhere), jddp.global_mean(x) for a mean over the batch (a loss, an accuracy, "
        "batch statistics), jax.lax.psum(x, 'data') for a sum or a count."
    )
