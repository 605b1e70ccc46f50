"""What jddp does with valid but unusual input: batches without a real example, masks in any container, a
source's own mask, 64-bit data. (Invalid input is in test_bad_inputs.py.)"""

from __future__ import annotations

import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.engine.step import unpacked


def loss_fn(params, model_state, batch, rng):
    x = batch["x"] if isinstance(batch, dict) else batch.x
    mask = batch.get("mask") if isinstance(batch, dict) else batch.mask
    return jddp.masked_mean((x @ params["w"]) ** 2, mask), (model_state, {})


class Batch(typing.NamedTuple):
    x: np.ndarray
    mask: np.ndarray


def setup():
    dp = jddp.DataParallel(loss_fn, optax.adamw(0.1, weight_decay=0.5), mesh=jddp.data_mesh())
    state = dp.init({"w": np.ones(3, np.float32)})
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    state, _ = dp.step(state, {"x": x, "mask": np.ones(8, np.float32)})  # Adam's moments are not zero now
    return dp, state, x


def host(state):
    return jax.tree.map(np.asarray, (state.params, state.opt_state, state.model_state))


@pytest.mark.parametrize("size", [8, 0], ids=["all-padding", "empty"])
def test_a_global_batch_without_a_real_example_changes_nothing_but_the_step(size):
    """AdamW would decay the weights and move its moments on a step of 0 examples; jddp takes no update."""
    dp, state, x = setup()
    before, step = host(state), int(state.step)
    state, metrics = dp.step(state, {"x": x[:size], "mask": np.zeros(size, np.float32)})
    assert metrics["examples"] == 0 and int(state.step) == step + 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(host(state)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_one_device_of_padding_is_normal_and_exact():
    dp, state, x = setup()
    mask = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)  # the last device's slice is all padding
    w = np.asarray(state.params["w"])
    _, metrics = dp.step(state, {"x": x, "mask": mask})
    expected = np.mean(((x @ w) ** 2)[:6])
    assert metrics["examples"] == 6
    np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-6)


def test_a_namedtuple_mask_weights_like_a_dict_mask():
    dp, state, x = setup()
    mask = np.array([1, 0, 1, 1, 0, 0, 1, 1], np.float32)
    _, as_dict = dp.step(state, {"x": x, "mask": mask})
    dp, state, x = setup()
    _, as_tuple = dp.step(state, Batch(x, mask))
    assert as_tuple["examples"] == as_dict["examples"] == 5
    assert as_tuple["loss"] == as_dict["loss"]


def mask_of(batch) -> np.ndarray:
    return np.asarray(unpacked(batch)["mask"]) if not isinstance(batch, dict) else np.asarray(batch["mask"])


@pytest.mark.parametrize("path", ["arrays", "records", "transform"])
def test_a_sources_own_mask_is_combined_with_the_padding(path):
    n = 20
    own = (np.arange(n) % 3 != 0).astype(np.float32)  # the source leaves out every third example
    x = np.arange(n, dtype=np.float32)
    if path == "arrays":
        source, kwargs = {"x": x, "mask": own}, {}
    elif path == "records":
        source, kwargs = [{"x": x[i], "mask": own[i]} for i in range(n)], {}
    else:
        source, kwargs = {"x": x, "mask": own}, {"transform": lambda example, rng: example}
    loader = jddp.data.DataLoader(source, global_batch_size=8, shuffle=False, drop_last=False, **kwargs)
    masks = np.concatenate([mask_of(b) for b in loader])
    xs = np.concatenate([np.asarray(unpacked(b)["x"]) for b in loader])
    expected = np.concatenate([own, np.zeros(4, np.float32)])  # 20 examples and 4 of padding
    np.testing.assert_array_equal(masks, expected)
    np.testing.assert_array_equal(xs[:n], x)


def test_64_bit_sources_are_narrowed_and_said_once_per_field():
    source = {"x": np.linspace(0, 1, 16), "y": np.arange(16)}  # NumPy's defaults: float64, int64
    with pytest.warns(jddp.data.DtypeWarning, match=r"'x' float64 -> float32, 'y' int64 -> int32") as caught:
        loader = jddp.data.DataLoader(source, global_batch_size=8, shuffle=False)
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", jddp.data.DtypeWarning)  # the same fields again: nothing more is said
        again = jddp.data.DataLoader(source, global_batch_size=8, shuffle=False)
    for batch in (next(iter(loader)), next(iter(again))):
        arrays = unpacked(batch)
        assert arrays["x"].dtype == jnp.float32 and arrays["y"].dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(arrays["x"]), source["x"][:8].astype(np.float32))
        np.testing.assert_array_equal(np.asarray(arrays["y"]), np.arange(8))
