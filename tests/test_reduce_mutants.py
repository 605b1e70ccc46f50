"""jddp.engine.reduce, fused and metrics against NumPy and hand computations: masked means of every dtype, example
counts, weighted sums and their errors, safe division and its gradient, the fused all-reduce's packing at its size
limit, and the Metrics mapping's reads, weights and repr."""

from __future__ import annotations

import re
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
from jddp.engine import comm, fused, reduce
from jddp.engine.metrics import Metrics

N = 8


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices")
    return jddp.data_mesh()


def reference_mean(values: np.ndarray, mask: np.ndarray) -> float:
    """sum(mean of each example * mask) / max(sum(mask), 1), in float64."""
    per_example = np.asarray(values, np.float64).reshape(len(values), -1).mean(axis=1)
    mask = np.asarray(mask, np.float64)
    return float((per_example * mask).sum() / max(mask.sum(), 1.0))


RNG = np.random.default_rng(0)
MEAN_CASES = {
    "float32, 0/1 mask": (RNG.normal(size=6).astype(np.float32), np.array([1, 1, 0, 1, 0, 1], np.int32)),
    "float32 [batch, 3, 2], bool mask": (RNG.normal(size=(5, 3, 2)).astype(np.float32), np.arange(5) % 2 == 0),
    "bool values, weights": (np.array([True, False, True, True]), np.array([0.5, 1.0, 2.0, 0.0], np.float32)),
    "int counts, weights": (np.array([3, 1, 4, 1], np.int32), np.array([0.5, 0.25, 1.0, 0.75], np.float32)),
    "all padding": (RNG.normal(size=4).astype(np.float32), np.zeros(4, np.float32)),
}


@pytest.mark.parametrize("name", list(MEAN_CASES))
def test_masked_mean_equals_the_numpy_reference(name):
    """Further axes are averaged per example; bools and ints count as floats; weights are kept fractional; a mask
    of zeros gives 0, not NaN."""
    values, mask = MEAN_CASES[name]
    got = reduce.masked_mean(jnp.asarray(values), jnp.asarray(mask))
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(float(got), reference_mean(values, mask), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])  # dtypes only: no array at import
def test_masked_mean_keeps_the_dtype_of_half_precision_values(dtype):
    """The mean of bf16 or f16 values is bf16 or f16, whatever the mask's dtype: the mask follows the values."""
    values = np.array([1.0, 2.0, 4.0, 8.0], dtype)
    mask = np.array([1.0, 0.5, 0.0, 1.0], np.float32)
    got = reduce.masked_mean(jnp.asarray(values), jnp.asarray(mask))
    assert got.dtype == dtype
    assert float(got) == reference_mean(values, mask) == 10.0 / 2.5


def test_masked_mean_under_x64_keeps_float64_and_counts_bools_in_float32():
    with jax.enable_x64(True):
        values = np.array([0.1, 0.2, 0.3], np.float64)
        got = reduce.masked_mean(jnp.asarray(values), jnp.asarray([1, 1, 0]))
        assert got.dtype == jnp.float64 and float(got) == (0.1 + 0.2) / 2
        assert reduce.masked_mean(jnp.asarray([True, False, True])).dtype == jnp.float32


def test_example_count_is_a_float32_sum_of_the_mask():
    """Counted in float32 from any mask dtype: 2049 ones of float16 (whose own sum rounds to 2048) count 2049."""
    count = reduce.example_count({"mask": np.array([True, False, True, True])}, 4)
    assert count.dtype == jnp.float32 and float(count) == 3.0
    count = reduce.example_count({"mask": np.ones(2049, np.float16)}, 2049)
    assert count.dtype == jnp.float32 and float(count) == 2049.0
    assert float(reduce.example_count({"x": np.ones(5)}, 5)) == 5.0


def test_as_weighted_multiplies_a_mean_by_the_count():
    w = reduce.as_weighted(jnp.float32(0.25), jnp.float32(12), "The loss")
    assert (float(w.total), float(w.weight)) == (3.0, 12.0)
    assert w.total.dtype == w.weight.dtype == jnp.float32
    w = reduce.as_weighted(jddp.Weighted(jnp.bfloat16(6), jnp.int32(4)), jnp.float32(12), "The loss")
    assert (float(w.total), float(w.weight)) == (6.0, 4.0)
    assert w.total.dtype == w.weight.dtype == jnp.float32


@pytest.mark.parametrize("value", [3_000_000_000, np.int64(3_000_000_000)], ids=["python-int", "numpy-int64"])
def test_as_weighted_converts_a_host_integer_beyond_int32_to_the_sum_dtype(value):
    """A mean given as a host integer is converted straight to float32: not through int32, which would overflow (a
    Python int) or wrap around to a negative number (a NumPy int64)."""
    w = reduce.as_weighted(value, jnp.float32(2), "Metric 'seen'")
    assert w.total.dtype == jnp.float32 and float(w.total) == float(np.float32(6e9))


def test_as_weighted_under_x64_keeps_float32_in_float32_and_float64_in_float64():
    with jax.enable_x64(True):
        w = reduce.as_weighted(jnp.float32(0.5), jnp.float32(4), "The loss")
        assert w.total.dtype == w.weight.dtype == jnp.float32
        w = reduce.as_weighted(jddp.Weighted(jnp.float32(2), jnp.float32(4)), jnp.float32(4), "The loss")
        assert w.total.dtype == w.weight.dtype == jnp.float32
        w = reduce.as_weighted(jnp.float64(0.1), jnp.float32(3), "The loss")
        assert w.total.dtype == w.weight.dtype == jnp.float64 and float(w.total) == 0.1 * 3


HINT = re.escape("Reduce it over the batch inside `loss_fn`, for example with `jddp.masked_mean(per_example, ")
HINT += re.escape("batch.get('mask'))`.") + "$"


@pytest.mark.parametrize(
    ("value", "part", "shape"),
    [  # built in the test, not here: an array made at import starts JAX's backend in mutmut's fork server
        (lambda: jnp.ones(4), "value", (4,)),
        (lambda: jddp.Weighted(jnp.ones(3), jnp.float32(3)), "value", (3,)),
        (lambda: jddp.Weighted(jnp.float32(3), jnp.ones(2)), "weight", (2,)),
    ],
    ids=["mean", "weighted-total", "weighted-weight"],
)
def test_a_value_that_is_not_a_scalar_is_named_with_its_shape(value, part, shape):
    value = value()
    expected = re.escape(f"but its {part} has shape={shape}. ")
    with pytest.raises(ValueError, match=rf"^The loss must be a scalar .*, {expected}{HINT}"):
        reduce.as_weighted(value, jnp.float32(4), "The loss")


def test_safe_divide_is_the_quotient_where_the_weight_is_positive_else_zero():
    total = jnp.array([5.0, 1.0, 3.0, 2.0, 7.0])
    weight = jnp.array([0.0, 0.5, 1.0, 4.0, -1.0])
    np.testing.assert_array_equal(reduce.safe_divide(total, weight), [0.0, 2.0, 3.0, 0.5, 0.0])


def test_safe_divide_has_a_zero_gradient_where_the_weight_is_zero():
    """The inner `where` keeps the unused quotient finite: differentiating through a zero weight gives 0, not NaN."""
    grad_total, grad_weight = jax.grad(lambda t, w: reduce.safe_divide(t, w), argnums=(0, 1))(3.0, 0.0)
    assert (float(grad_total), float(grad_weight)) == (0.0, 0.0)
    grad_total, grad_weight = jax.grad(lambda t, w: reduce.safe_divide(t, w), argnums=(0, 1))(3.0, 2.0)
    assert (float(grad_total), float(grad_weight)) == (0.5, -0.75)


def test_fused_psum_packs_leaves_up_to_the_limit_and_sums_as_numpy(mesh):
    """A leaf of exactly `max_leaf_bytes` is packed with its dtype's small leaves, one byte more is its own operand;
    every leaf equals the NumPy sum over the devices, for mixed dtypes and shapes."""
    rng = np.random.default_rng(1)
    tree = {
        "at": rng.normal(size=(N, 16)).astype(np.float32),  # 64 bytes: the limit
        "over": rng.normal(size=(N, 17)).astype(np.float32),  # 68 bytes
        "m": rng.normal(size=(N, 2, 3)).astype(np.float32),
        "s": rng.normal(size=(N,)).astype(np.float32),
        "n": rng.integers(-9, 9, size=(N, 4)).astype(np.int32),
        "i": rng.integers(-9, 9, size=(N, 17)).astype(np.int32),  # 68 bytes
    }
    body = lambda t: fused.fused_psum(jax.tree.map(lambda x: x[0], t), "data", max_leaf_bytes=64)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
    got = fn(tree)
    for k, x in tree.items():
        assert got[k].shape == x.shape[1:] and got[k].dtype == x.dtype
        np.testing.assert_allclose(got[k], x.astype(np.float64).sum(0), rtol=1e-6, atol=1e-6)
    report = comm.CommReport.from_hlo(fn.lower(tree).compile().as_text())
    operands = sorted(op for c in report.collectives for op in c.operands)
    assert operands == [("f32", (17,)), ("f32", (23,)), ("s32", (4,)), ("s32", (17,))]


def test_metrics_read_values_and_weights_of_an_eval_vector():
    """An eval vector carries each mean's weight after the values; `examples` has none."""
    m = Metrics(("loss", "accuracy", "examples"), jnp.array([0.5, 0.75, 40.0, 40.0, 32.0]))
    assert dict(m) == {"loss": 0.5, "accuracy": 0.75, "examples": 40.0}
    assert m.weights == {"loss": 40.0, "accuracy": 32.0}


def test_metrics_with_fewer_values_than_names_refuse_to_be_read():
    m = Metrics(("loss", "accuracy"), jnp.array([0.5]))
    message = (
        "Metrics: 1 value(s) for the 2 names ['loss', 'accuracy']; build Metrics from a vector with one value per "
        "name (and, for eval_step's, one weight per mean after them)."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dict(m)


def test_metrics_repr_shows_values_once_readable_and_names_before(mesh):
    """A host-readable vector shows its values; one still sharded over devices and not read shows only the names
    (a read would wait for the step); once read, the values."""
    m = Metrics(("loss", "accuracy"), jnp.array([0.5, 0.125]))
    assert repr(m) == "Metrics(loss=0.5, accuracy=0.125)"
    names = tuple("abcdefgh")
    sharded = jax.device_put(np.arange(N, dtype=np.float32) / 4, NamedSharding(mesh, P("data")))
    m = Metrics(names, sharded)
    assert not sharded.is_fully_replicated
    assert repr(m) == "Metrics(['a', 'b', 'c', 'd', 'e', 'f', 'g', 'h'])"
    assert m["h"] == 1.75
    assert repr(m) == "Metrics(a=0, b=0.25, c=0.5, d=0.75, e=1, f=1.25, g=1.5, h=1.75)"


def test_find_mask_finds_a_dataclass_batchs_mask():
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: np.ndarray
        mask: np.ndarray

    mask = np.array([1.0, 0.0], np.float32)
    assert reduce.find_mask(Batch(np.zeros(2), mask)) is mask
    assert reduce.find_mask((np.zeros(2), mask)) is None  # a plain tuple has no named field

    class NoMask(typing.NamedTuple):
        x: np.ndarray

    assert reduce.find_mask(NoMask(np.zeros(2))) is None  # a NamedTuple without a mask: no mask, no error


def test_a_float64_weight_keeps_the_weighted_pair_in_float64():
    with jax.enable_x64(True):
        w = reduce.as_weighted(jddp.Weighted(jnp.float32(1.0), jnp.float64(3.0)), jnp.float32(2.0), "The loss")
        assert w.total.dtype == jnp.float64 and w.weight.dtype == jnp.float64
