"""What a batch may hold on its way to the devices: dtypes checked and narrowed, masks and local rows checked.

The reads (``jddp.data.reading``) and ``DataLoader.to_global`` pass every field through ``canonical``: numbers and
bools only, whole bytes a value, 64-bit narrowed to the 32-bit types the devices use unless x64 is on.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jddp import validate
from jddp.data import sampler as sampler_lib

Example = dict[str, np.ndarray]

# What the devices take, as ``jnp.asarray`` does without x64: 64-bit numbers become 32-bit.
_NARROW = {
    np.dtype(np.float64): np.float32,
    np.dtype(np.int64): np.int32,
    np.dtype(np.uint64): np.uint32,
    np.dtype(np.complex128): np.complex64,
}


def canonical(name: str, array: np.ndarray, what: str = "the source") -> np.ndarray:
    """``array`` in a dtype the devices take (64-bit narrowed unless x64 is on); strings and objects refused."""
    dtype = array.dtype
    if not validate.goes_to_device(dtype):
        raise TypeError(
            f"DataLoader field {name!r} of {what} has dtype {dtype} ({_KINDS[dtype.kind]}): only numbers and "
            "bools can go to the devices. Encode it as numbers (e.g. integer ids), drop it from the source, or "
            "turn it into numbers in `transform`."
        )
    if (validate.bits(dtype) or 8) % 8:
        raise TypeError(
            f"DataLoader field {name!r} of {what} has dtype {dtype}, of {validate.bits(dtype)} bits a value: the "
            "loader moves whole bytes. Store it as int8/uint8 (or a float8 type) and cast it in the step."
        )
    narrow = _NARROW.get(dtype)
    if narrow is None or jax.config.read("jax_enable_x64"):
        return array
    return array.astype(narrow)


class DtypeWarning(UserWarning):
    """The loader narrowed 64-bit source fields to the 32-bit types the devices use (said once per field)."""


_SAID: set[tuple[str, str]] = set()


def say_narrowed(said: dict[str, str]) -> None:
    new = {k: v for k, v in said.items() if (k, v) not in _SAID}  # once per process
    _SAID.update(new.items())
    if new:
        fields = ", ".join(f"{k!r} {v}" for k, v in new.items())
        warnings.warn(
            f"DataLoader: source fields {fields}, as jnp.asarray does without jax_enable_x64 (NumPy's default is "
            "64-bit; the devices compute in 32-bit). Convert the source yourself to silence this.",
            DtypeWarning,
            stacklevel=3,
        )


_KINDS = {"O": "Python objects", "U": "strings", "S": "bytes", "V": "raw records", "M": "datetimes", "m": "timedeltas"}


def check_source_mask(mask: np.ndarray, what: str) -> np.ndarray:
    """A source's own ``mask`` (0 to leave an example out) as float32, checked: 0/1 per example."""
    mask = np.asarray(mask)
    if mask.ndim != 1:
        raise ValueError(
            f"The 'mask' field of {what} must be 0/1 per example (shape [N]), got shape {mask.shape}. It is "
            "combined with the padding mask; name a mask of another shape otherwise (e.g. 'token_mask')."
        )
    bad = mask[(mask != 0) & (mask != 1)]
    if bad.size:
        raise ValueError(f"The 'mask' field of {what} must be 0 or 1, got {bad[0].item()!r} among its values.")
    return mask.astype(np.float32)


def checked_local(local: Any, sampler: sampler_lib.DistributedBatchSampler, padded_batch_size: int) -> Example:
    """``local`` as ``to_global`` packs it: NumPy arrays in the dtypes the devices take, or an error naming it."""
    what = "what local_batches() yields: a dict of arrays with one row per example"
    if not isinstance(local, Mapping):
        raise TypeError(f"`local` must be {what}, got {type(local).__name__}.")
    if not local:
        raise ValueError(f"`local` must be {what}, got an empty mapping.")
    arrays = {}
    for key, value in local.items():
        if isinstance(value, jax.Array) and value.is_deleted():
            raise ValueError(f"`local` holds a deleted jax.Array at {key!r} (donated to a step?); pass live arrays.")
        if not isinstance(value, np.ndarray | jax.Array) or value.ndim == 0:
            shown = f"shape {value.shape}" if hasattr(value, "shape") else type(value).__name__
            raise TypeError(f"`local` must be {what}, got {shown} at {key!r}.")
        arrays[str(key)] = canonical(str(key), np.asarray(value), "`local`")
    rows = {k: len(v) for k, v in arrays.items()}
    if set(rows.values()) != {sampler.local_batch_size}:
        raise ValueError(
            f"`local` must hold this process's {sampler.local_batch_size} rows in every array "
            f"(padded_batch_size={padded_batch_size} over {sampler.num_replicas} process(es)), got "
            f"rows {rows}."
        )
    return arrays
