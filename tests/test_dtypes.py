"""Every dtype JAX computes in is taken wherever an array goes to the devices: generated from NumPy's and ml_dtypes'
number types, so that a type added tomorrow is checked too.

NumPy files ml_dtypes' numbers (bfloat16, the float8 types, int4) under raw records, kind ``V``, with what cannot go
to a device: checks written with ``dtype.kind`` or ``np.issubdtype`` refused a bfloat16 model's parameters, its
dataset and its mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jddp
from jddp import validate
from jddp.engine import checks


def _number_types() -> list[type]:
    """NumPy's number types and every ml_dtypes type that JAX puts on a device (the definition of a number here)."""
    numpy_types = [np.bool_, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.float16, np.float32]
    extra = []
    for name in sorted(dir(ml_dtypes)):
        kind = getattr(ml_dtypes, name)
        if isinstance(kind, type) and issubclass(kind, np.generic):
            try:
                jax.device_put(np.zeros(2, kind))
            except Exception:  # complex32, float6: no JAX array type, or none on XLA:CPU
                continue
            extra.append(kind)
    return numpy_types + extra


TYPES = _number_types()
FLOATS = [t for t in TYPES if jnp.issubdtype(t, jnp.floating)]
WHOLE_BYTES = [t for t in TYPES if (validate.bits(t) or 0) % 8 == 0]


def test_the_generator_finds_ml_dtypes_numbers():
    names = {np.dtype(t).name for t in TYPES}
    assert {"bfloat16", "float8_e4m3fn", "int4"} <= names, names


def test_every_number_type_goes_to_the_devices_through_the_loader_and_the_batch_check():
    """One loader with a field of every whole-byte type: each arrives bit for bit (and is a valid mask where 0 and 1
    are values of it); a type of fewer bits (int4, float4) is refused naming the field, the type and the fix (NumPy
    stores them a byte each, JAX packs them)."""
    values = np.arange(16).reshape(8, 2) % 2
    mesh = jddp.data_mesh(jax.devices()[:1])
    source = {f"x{i}": values.astype(kind) for i, kind in enumerate(WHOLE_BYTES)} | {"y": np.arange(8, dtype=np.int32)}
    batch = next(iter(jddp.data.DataLoader(source, global_batch_size=8, seed=0, shuffle=False, mesh=mesh)))
    for i, kind in enumerate(WHOLE_BYTES):
        assert validate.goes_to_device(kind)
        got = batch[f"x{i}"]
        assert got.dtype == np.dtype(kind) and np.asarray(got).tobytes() == source[f"x{i}"].tobytes(), kind
        if np.array_equal(values.astype(kind).astype(np.float32), values):  # float8_e8m0fnu has no 0
            checks.check_mask({"mask": values[:, 0].astype(kind)}, 8, every_value=True)
    for kind in (t for t in TYPES if t not in WHOLE_BYTES):
        assert validate.goes_to_device(kind)
        with pytest.raises(TypeError, match=rf"field 'x' .* has dtype {np.dtype(kind).name}, of \d bits .* int8"):
            jddp.data.DataLoader({"x": values.astype(kind)}, global_batch_size=8, seed=0, mesh=mesh)


@pytest.mark.parametrize("kind", TYPES, ids=lambda t: np.dtype(t).name)
def test_parameters_of_every_float_type_are_trainable_and_of_no_other(kind):
    params = {"w": np.ones((2, 2), kind)}
    if kind in FLOATS:
        checks.check_trainable(params)
    else:
        with pytest.raises(TypeError, match=r"params\['w'\] has dtype"):
            checks.check_trainable(params)


@pytest.mark.parametrize("kind", ["U3", "O", "V8", "M8[s]"])
def test_what_is_not_a_number_is_still_refused(kind):
    assert not validate.goes_to_device(kind)


@pytest.mark.parametrize("name", ["compute_dtype", "reduce_dtype"])
def test_float64_without_x64_is_refused_not_narrowed(monkeypatch, name):
    """Without jax_enable_x64 JAX computes float64 in float32 without a word: the engine refuses it, naming the
    argument and the fix; with x64 on it is taken."""

    def loss_fn(p, m, b, r):
        return jnp.mean(b["x"] @ p["w"]), (m, {})

    monkeypatch.setattr(checks, "_x64", lambda: False)
    with pytest.raises(ValueError, match=rf"`{name}=float64` needs 64-bit floats.*jax_enable_x64"):
        jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), **{name: jnp.float64})
    monkeypatch.setattr(checks, "_x64", lambda: True)
    jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), **{name: jnp.float64})
