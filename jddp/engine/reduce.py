"""Exact weighted means across devices.

A loss or metric reaches the engine in one of two forms:

* a scalar: the mean over the local batch's real examples. The engine weights
  it by their count, ``sum(batch["mask"])`` (the local batch size when there is
  no mask);
* ``Weighted(total, weight)``: a sum and what it is a sum over (tokens, pixels).

Either way the engine ``psum``\\ s the totals and the weights and divides once,
so the result is the exact global mean however examples are spread over
devices (DDP's average of per-device averages is not, for uneven batches).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jddp.runtime import state as state_lib


class Weighted(NamedTuple):
    """A sum and its weight; the engine reports ``psum(total) / psum(weight)``.

    Example:
      >>> import jax.numpy as jnp, jddp
      >>> per_token = jnp.array([1.0, 2.0, 3.0]); mask = jnp.array([1.0, 1.0, 0.0])
      >>> w = jddp.Weighted(jnp.sum(per_token * mask), jnp.sum(mask))
      >>> float(w.total / w.weight)
      1.5
    """

    total: jax.Array
    weight: jax.Array


def masked_mean(values: jax.Array | np.ndarray, mask: jax.Array | np.ndarray | None = None) -> jax.Array:
    """The mean of ``values`` over the examples where ``mask`` is non-zero.

    Args:
      values: per-example values, leading axis the batch; further axes are
        averaged too.
      mask: ``[batch]`` of 0/1 (or weights), or ``None`` for all ones.

    Returns:
      A scalar; 0 (not NaN) when the mask is all zeros, so that a device whose
      examples are all padding contributes nothing.

    Raises:
      TypeError: if ``values`` or ``mask`` is not an array of real numbers or
        bools (a list, a string).
      ValueError: if ``mask`` is not ``[batch]`` for ``values``' leading axis,
        or an array was donated.

    Example:
      >>> import jax.numpy as jnp, jddp
      >>> float(jddp.masked_mean(jnp.array([1.0, 2.0, 9.0]), jnp.array([1, 1, 0])))
      1.5
    """
    _check_values("values", values)
    if mask is not None:
        _check_values("mask", mask)
        if np.ndim(values) == 0 or np.shape(mask) != np.shape(values)[:1]:
            raise ValueError(
                f"`mask` must be [batch] for `values` of shape {np.shape(values)}: one 0/1 per example of the "
                f"leading axis, got mask of shape {np.shape(mask)}."
            )
    values = jnp.asarray(values)
    if not jnp.issubdtype(values.dtype, jnp.inexact):
        values = values.astype(jnp.float32)  # booleans (accuracy) and counts
    if mask is None:
        return jnp.mean(values)
    mask = jnp.asarray(mask, values.dtype)
    per_example = values.reshape(values.shape[0], -1).mean(axis=1)
    return jnp.sum(per_example * mask) / jnp.maximum(jnp.sum(mask), 1)


def _check_values(name: str, x) -> None:
    """``x`` an array of real numbers or bools, live (a Python number or bool is a scalar one)."""
    if isinstance(x, bool | int | float) and not isinstance(x, np.generic):
        return
    state_lib.check_array(name, x)


def find_mask(batch):
    """The batch's ``mask`` (0/1 per example, 0 for padding), or None: the top-level field named ``mask`` of a
    mapping, a NamedTuple or a dataclass (deeper fields are the model's inputs, e.g. attention masks)."""
    if isinstance(batch, Mapping):
        return batch.get("mask")
    if (isinstance(batch, tuple) and hasattr(batch, "_fields")) or dataclasses.is_dataclass(batch):
        return getattr(batch, "mask", None)
    return None


def sum_dtype(*dtypes) -> jnp.dtype:
    """The dtype that sums and means of values of ``dtypes`` are kept in: float32, or float64 when one of them is
    float64 (with ``jax_enable_x64``). bf16 and f16 values are summed in float32, as before."""
    return jnp.result_type(jnp.float32, *(d for d in dtypes if jnp.issubdtype(d, jnp.floating)))


def example_count(batch, batch_size: int) -> jax.Array:
    """The number of real examples of a local batch: the sum of its mask (``find_mask``), else its size."""
    mask = find_mask(batch)
    if mask is not None:
        return jnp.sum(jnp.asarray(mask, jnp.float32))
    return jnp.float32(batch_size)


def as_weighted(value, count: jax.Array, what: str) -> Weighted:
    """``value`` (a scalar mean or a ``Weighted``) as a ``Weighted`` in ``sum_dtype`` (float64 values stay
    float64)."""
    if isinstance(value, Weighted):
        total, weight = jnp.asarray(value.total), jnp.asarray(value.weight)
        checked = total
    else:
        total, weight = None, count
        checked = value
    for name, x in (("value", checked), ("weight", weight)):
        shape = jnp.shape(x)
        if shape != ():
            raise ValueError(
                f"{what} must be a scalar (or `jddp.Weighted` of scalars), but its {name} "
                f"has shape={shape}. Reduce it over the batch inside `loss_fn`, for "
                "example with `jddp.masked_mean(per_example, batch.get('mask'))`."
            )
    dtype = sum_dtype(jnp.result_type(checked), jnp.result_type(weight))
    if total is None:
        total = jnp.asarray(value, dtype) * count.astype(dtype)
    return Weighted(total.astype(dtype), weight.astype(dtype))


def safe_divide(total: jax.Array, weight: jax.Array) -> jax.Array:
    """``total / weight``, 0 where ``weight`` is 0."""
    return jnp.where(weight > 0, total / jnp.where(weight > 0, weight, 1), 0.0)
