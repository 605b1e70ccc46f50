"""``DataParallel``'s argument checks: options, calls, batches, the loss output and the initial state."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jddp import validate
from jddp.engine import contracts, reduce
from jddp.runtime import packing
from jddp.runtime import state as state_lib

MSG_LOSS_OUTPUT = (
    "`loss_fn` must return `(loss, (new_model_state, metrics))`, where `loss` is a "
    "scalar mean over the local batch's real examples or a `jddp.Weighted(total, "
    "weight)`, `new_model_state` is the model state (`{{}}` if none) and `metrics` a "
    "dict of scalars. It returned {got}."
)


@dataclasses.dataclass(frozen=True)
class Options:
    """``DataParallel``'s options, checked when made."""

    accumulate_steps: int
    reduce_dtype: Any
    clip_grad_norm: float | None
    nonfinite: str
    donate: bool
    max_inflight: int
    fuse_allreduce: bool | None
    shard_optimizer: bool = False
    rng: str = "example"
    grad_hook: Any = None
    local_metrics: bool = False
    compute_dtype: Any = None

    @property
    def loss_scaled(self) -> bool:
        """float16 compute: the loss is scaled (``jddp.engine.loss_scale``); bfloat16 has float32's range."""
        return self.compute_dtype is not None and float(jnp.finfo(self.compute_dtype).max) < 1e6

    def __post_init__(self):
        validate.check_int("accumulate_steps", self.accumulate_steps)
        if self.reduce_dtype is not None and not is_float_dtype(self.reduce_dtype):
            raise ValueError(
                f"`reduce_dtype` must be a float dtype such as jnp.bfloat16 or None, "
                f"got reduce_dtype={self.reduce_dtype!r}."
            )
        c = self.clip_grad_norm
        if c is not None and (isinstance(c, bool) or not (isinstance(c, int | float) and c > 0 and np.isfinite(c))):
            raise ValueError(f"`clip_grad_norm` must be a positive number or None, got clip_grad_norm={c!r}.")
        if self.nonfinite not in ("skip", "raise", "ignore"):
            raise ValueError(f"`nonfinite` must be 'skip', 'raise' or 'ignore', got nonfinite={self.nonfinite!r}.")
        validate.check_bool("donate", self.donate)
        validate.check_int("max_inflight", self.max_inflight)
        if self.fuse_allreduce is not None and not isinstance(self.fuse_allreduce, bool):
            raise ValueError(
                f"`fuse_allreduce` must be True, False or None (automatic), got fuse_allreduce={self.fuse_allreduce!r}."
            )
        if not isinstance(self.shard_optimizer, bool):
            raise ValueError(f"`shard_optimizer` must be True or False, got shard_optimizer={self.shard_optimizer!r}.")
        if self.grad_hook is not None and not callable(self.grad_hook):
            raise TypeError(
                f"`grad_hook` must be a function (grads, params) -> grads or (grads, metrics), or None, got "
                f"{type(self.grad_hook).__name__}."
            )
        if not isinstance(self.local_metrics, bool):
            raise ValueError(f"`local_metrics` must be True or False, got local_metrics={self.local_metrics!r}.")
        if self.compute_dtype is not None and not is_float_dtype(self.compute_dtype):
            raise ValueError(
                "`compute_dtype` must be a float dtype such as jnp.bfloat16 (the forward and backward pass in it, "
                f"params and optimizer state kept in theirs) or None, got compute_dtype={self.compute_dtype!r}."
            )
        for name in ("compute_dtype", "reduce_dtype"):  # a dtype the backend would narrow without a word
            value = getattr(self, name)
            if value is not None and is_float_dtype(value) and np.dtype(value).itemsize == 8 and not _x64():
                raise ValueError(
                    f"`{name}=float64` needs 64-bit floats, which JAX has off (jax_enable_x64): it would compute in "
                    f"float32 without a word. Call jax.config.update('jax_enable_x64', True) before building the "
                    f"arrays, or use {name}=jnp.float32."
                )
        if self.loss_scaled and self.nonfinite == "ignore":
            raise ValueError(
                f"`compute_dtype={np.dtype(self.compute_dtype).name}` scales the loss and must skip the steps whose "
                "gradient overflows: use nonfinite='skip' (the default) or 'raise', not 'ignore'."
            )
        if self.loss_scaled and self.shard_optimizer:
            raise ValueError(
                f"`compute_dtype={np.dtype(self.compute_dtype).name}` (loss scaling) is not built for "
                "shard_optimizer=True yet; use compute_dtype=jnp.bfloat16, which needs no loss scale."
            )
        if self.rng not in ("example", "device"):
            raise ValueError(
                f"`rng` must be 'example' (an example's random draws follow its place in the global batch) or "
                f"'device' (one key per device), got rng={self.rng!r}."
            )


def _x64() -> bool:
    return bool(jax.config.read("jax_enable_x64"))


def check_call(dp, state, batch, what: str = "batch", *, accumulated: bool = True) -> None:
    """Before a program runs: ``state`` live and from this mesh, ``batch`` (named ``what`` in errors) live at every
    call and splittable (checked once per batch shape): by the devices, and by ``accumulate_steps`` too unless not
    ``accumulated`` (an evaluation takes its batch whole)."""
    check_state(dp, state)
    leaves, treedef = jax.tree.flatten(batch)
    for x in leaves:  # a deleted array keeps its shape: checked at every call, one call per leaf
        if isinstance(x, jax.Array) and x.is_deleted():
            deleted = [jax.tree_util.keystr(p) for p, y in jax.tree.leaves_with_path(batch) if y is x]
            raise ValueError(
                f"{what}{deleted[0] if deleted else ''} is a deleted jax.Array (donated to a program, or deleted): "
                f"`{what}` must hold live arrays. Pass a batch that no earlier call donated."
            )
    micro = dp.options.accumulate_steps if accumulated else 1
    signature = (treedef, tuple(np.shape(x) for x in leaves), micro)
    if signature != dp._checked:
        check_batch(dp, batch, leaves, what, micro)
        check_mask(batch, np.shape(leaves[0])[0], every_value=True, what=what)
        dp._checked = signature
    else:
        check_mask(batch, np.shape(leaves[0])[0], every_value=False, what=what)


def check_state(dp, state) -> None:
    """``state`` a live ``TrainState`` (``jddp.runtime.state.check_state``) on this engine's mesh."""
    state_lib.check_state("state", state)
    sharding = state.step.sharding
    if sharding is not dp._rep and sharding != dp._rep:
        raise ValueError(
            f"`state` lives on another mesh: its sharding is {sharding}, but this DataParallel "
            f"uses {dp._rep}. Build the state with this object's `init`, or restore the "
            "checkpoint onto this mesh."
        )


def check_batch(dp, batch, leaves, what: str = "batch", micro_batches: int | None = None) -> None:
    """Every leaf with one leading size that the devices and micro-batches divide; global arrays across processes."""
    if isinstance(batch, list) and batch and all(isinstance(b, Mapping) for b in batch):
        raise TypeError(
            f"`{what}` must be one global batch (a dict, NamedTuple or dataclass of arrays whose leading axis is the "
            f"batch), got a list of {len(batch)} dict(s): a list of examples or of batches. "
            "Stack the examples into arrays (`np.stack`), or pass the batches one per call."
        )
    if not leaves:
        raise ValueError(f"`{what}` has no array leaves; pass a dict of arrays with a batch axis.")
    sizes = {jax.tree_util.keystr(path): np.shape(x)[:1] for path, x in jax.tree.leaves_with_path(batch)}
    leading = {s[0] if s else None for s in sizes.values()}
    if len(leading) != 1 or None in leading:
        raise ValueError(
            f"Every leaf of `{what}` must have the same leading (batch) size, got "
            + ", ".join(f"{k or what}: {v[0] if v else 'scalar'}" for k, v in sizes.items())
            + "."
        )
    for path, x in jax.tree.leaves_with_path(batch):
        dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
        if not validate.goes_to_device(dtype):
            raise TypeError(
                f"{what}{jax.tree_util.keystr(path)} has dtype {dtype}: only numbers and bools can go to the "
                "devices. Encode it as numbers (e.g. integer ids) or keep it out of the batch."
            )
    (size,) = leading
    n, k = dp.num_devices, dp.options.accumulate_steps if micro_batches is None else micro_batches
    if size % (n * k):
        raise ValueError(
            f"The global batch size of `{what}` must be divisible by the number of devices times "
            f"`accumulate_steps`, got global_batch_size={size}, devices={n}, "
            f"accumulate_steps={k}. Use a global batch size that is a multiple of {n * k}."
        )
    if jax.process_count() > 1 and not all(isinstance(x, jax.Array) for x in leaves):
        raise TypeError(
            f"In a multi-process run every leaf of `{what}` must be a global jax.Array; use "
            "`jddp.data.DataLoader` or `jax.make_array_from_process_local_data`."
        )


def check_mask(batch, size: int, *, every_value: bool, what: str = "batch") -> None:
    """The batch's ``mask``, if any: 0/1 of shape ``[B]``.

    Its shape always; its values when it is on the host (NumPy: cheap, at every call) and, for a ``jax.Array``,
    the first time a batch of this shape is seen (reading device values waits for them: not at every step).
    """
    mask = reduce.find_mask(batch)
    if mask is None:
        return
    shape = np.shape(mask)
    if shape != (size,):
        raise ValueError(
            f"`{what}`'s mask must mark each example with 0 (padding) or 1 (real), shape [{size}], got shape "
            f"{shape}. A mask of another shape (per token, [B, 1]) would weight the loss wrongly: squeeze it to "
            "[B], or name a per-token mask otherwise (e.g. 'token_mask') and return a jddp.Weighted loss."
        )
    dtype = np.dtype(mask.dtype if hasattr(mask, "dtype") else np.asarray(mask).dtype)
    if not (jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_) or jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(f"`{what}`'s mask must be a real or bool array of 0/1, got dtype {dtype}.")
    if isinstance(mask, jax.Array) and not every_value:
        return
    if isinstance(mask, jax.Array):
        values = np.concatenate([np.asarray(s.data).reshape(-1) for s in mask.addressable_shards])
    else:
        values = np.asarray(mask)
    bad = values[(values != 0) & (values != 1)]
    if bad.size:
        raise ValueError(
            f"`{what}`'s mask must be 0 (padding) or 1 (real example), got {bad[0].item()!r} among its values. For "
            "weights per example, return a jddp.Weighted(total, weight) loss instead."
        )


def unpack_loss(out):
    try:
        loss, (model_state, metrics) = out
    except (TypeError, ValueError):
        raise TypeError(MSG_LOSS_OUTPUT.format(got=describe(out))) from None
    return loss, (model_state, metrics)


def describe(x) -> str:
    if isinstance(x, tuple):
        inner = ", ".join(type(v).__name__ for v in x[:3])
        hint = ""
        if len(x) == 2 and isinstance(x[1], dict):
            hint = " (the metrics alone as its second element: return (loss, (model_state, metrics)), the model state "
            hint += "passed in unchanged if the model has none)"
        return f"a tuple of {len(x)} ({inner}{', ...' if len(x) > 3 else ''}){hint}"
    return f"{type(x).__name__} {getattr(x, 'shape', '')}".strip()


def is_float_dtype(value) -> bool:
    """Whether ``value`` names a floating dtype (``jnp.bfloat16``, ``"float16"``); False for anything NumPy cannot
    read as a dtype."""
    if not isinstance(value, type | np.dtype | str):
        return False
    try:
        return bool(jnp.issubdtype(value, jnp.floating))
    except TypeError:
        return False


def unpack_hook(out, grads) -> tuple[Any, dict]:
    """``grad_hook``'s result as (grads, metrics): the tree, shapes and dtypes of ``grads``, and a dict of scalars
    (``contracts.HOOK_GRADS``, ``contracts.HOOK_METRICS``: checked on avals while tracing)."""
    pair = isinstance(out, tuple) and len(out) == 2 and jax.tree.structure(out[0]) == jax.tree.structure(grads)
    new, metrics = out if pair or (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)) else (out, {})
    contracts.check(contracts.HOOK_GRADS, new, grads)
    contracts.check(contracts.HOOK_METRICS, metrics)
    return new, metrics


def check_metric_names(user: dict, builtin: dict) -> None:
    clash = sorted(set(user) & set(builtin))
    if clash:
        raise ValueError(f"Metric names {clash} are reserved by jddp ({sorted(builtin)}); rename them.")


def host_copy(tree, what: str):
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


def check_trainable(params) -> None:
    """Every leaf of ``params`` is floating point (a gradient of an integer leaf does not exist)."""
    for path, x in jax.tree.leaves_with_path(params):
        if not jnp.issubdtype(x.dtype, jnp.inexact):  # bfloat16 and float8 too (NumPy files them as kind "V")
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} has dtype {x.dtype}, but parameters are trained by gradients, "
                "which need floating point. Cast it (e.g. `.astype(np.float32)`), or move integer state "
                "(counters, indices, masks) to `model_state`."
            )


def key_data(rng) -> np.ndarray:
    if isinstance(rng, int) and not isinstance(rng, bool):
        rng = jax.random.key(rng)
    if not isinstance(rng, jax.Array | np.ndarray):
        raise TypeError(f"`rng` must be a JAX PRNG key or an int seed, got {type(rng).__name__}.")
    if state_lib.is_deleted(rng):
        raise ValueError(state_lib.MSG_DONATED.format(name="rng"))
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    data = np.array(jax.device_get(rng), copy=True)
    if data.dtype != np.uint32 or data.shape != (2,):
        raise ValueError(
            f"`rng` must be a threefry key (uint32[2] key data), got dtype={data.dtype}, shape={data.shape}."
        )
    return data


USER_CODE_NOTE = "jddp: raised while tracing"


@contextlib.contextmanager
def user_code(fn, call: str, batch, params, num_devices: int, accumulate_steps: int = 1):
    """Adds a note to an error raised while jax traces the user's ``fn`` inside ``call``: which function, and
    the shapes it saw (the device's slice of the batch, not the global batch), which is where most mistakes in a
    ported loss come from. The error keeps its type and traceback; errors of the compiled program (a failed
    collective) pass unchanged."""
    try:
        yield
    except jax.errors.JaxRuntimeError:
        raise
    except Exception as error:
        if not any(note.startswith(USER_CODE_NOTE) for note in getattr(error, "__notes__", ())):
            error.add_note(_user_code_note(fn, call, batch, params, num_devices, accumulate_steps))
        raise


def _user_code_note(fn, call: str, batch, params, num_devices: int, accumulate_steps: int) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    name = getattr(inner, "__qualname__", type(inner).__name__)
    code = getattr(inner, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    accumulated = f" and {accumulate_steps} accumulation steps" if accumulate_steps > 1 else ""
    batch = described(batch)
    global_size = next((np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)), 0)

    def shapes(tree, per_device: bool, limit: int = 8) -> str:
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        parts = []
        for path, x in flat[:limit]:
            shape = list(np.shape(x))
            if per_device and shape:
                shape[0] //= num_devices * accumulate_steps
            dtype = getattr(x, "dtype", type(x).__name__)
            parts.append(f"{jax.tree_util.keystr(path) or 'batch'}: {dtype}{shape}")
        more = f", ... ({len(flat) - limit} more)" if len(flat) > limit else ""
        return ", ".join(parts) + more

    return (
        f"{USER_CODE_NOTE} {name}{where} in {call}. It runs once per device under jax.jit and shard_map, on the "
        f"device's slice of the batch ({shapes(batch, True)}: the global batch of {global_size} split over "
        f"{num_devices} device(s){accumulated}), with params {shapes(params, False)}. Values are abstract there: "
        "Python `if`, `float()` or `.item()` on an array fail (use jnp.where or jax.lax.cond)."
    )


def described(batch):
    """The batch as the user's ``loss_fn`` sees it: a ``PackedBatch`` (from ``jddp.data.DataLoader``) as the dict
    of its arrays' shapes and dtypes, not the packed ``uint8`` buffer it travels in."""
    if not isinstance(batch, packing.PackedBatch):
        return batch
    rows = np.shape(batch.data)[0]
    return {f.name: jax.ShapeDtypeStruct((rows, *f.shape), np.dtype(f.dtype)) for f in batch.layout}
