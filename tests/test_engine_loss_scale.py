"""The float16 loss scale (``jddp.engine.loss_scale``) against GradScaler's rule written out in plain Python, and
the gradients of a float16 or bfloat16 forward pass returned and all-reduced in the parameters' dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.engine import loss_scale
from tests import models


def _reference(finite: list[bool], scale: float, good: int) -> tuple[float, int]:
    """GradScaler's update (PyTorch ``torch.amp.GradScaler.update``, growth 2, backoff 0.5), clamped to jddp's
    bounds: a non-finite step halves the scale and restarts the count; ``GROWTH_INTERVAL`` finite steps in a row
    double it."""
    for ok in finite:
        if not ok:
            scale, good = max(scale / 2, loss_scale.MIN_SCALE), 0
            continue
        good += 1
        if good >= loss_scale.GROWTH_INTERVAL:
            scale, good = min(scale * 2, loss_scale.MAX_SCALE), 0
    return scale, good


def _sequences():
    """Runs of finite steps around the growth interval, overflows between them, and scales at both bounds."""
    g = loss_scale.GROWTH_INTERVAL
    rng = np.random.default_rng(0)
    yield "grow once", [True] * g, loss_scale.INITIAL_SCALE, 0
    yield "one short of growing", [True] * (g - 1), loss_scale.INITIAL_SCALE, 0
    yield "overflow restarts the count", [True] * (g - 1) + [False] + [True] * (g - 1), loss_scale.INITIAL_SCALE, 0
    yield "halve to the floor", [False] * 40, 8.0, 3
    yield "grow to the ceiling", [True] * (3 * g), loss_scale.MAX_SCALE / 2, g - 5
    for i in range(4):
        yield f"random {i}", list(rng.random(3 * g) > 10 ** -(i + 1)), 2.0 ** rng.integers(1, 24), int(rng.integers(g))


SEQUENCES = list(_sequences())


@pytest.mark.parametrize(("finite", "scale", "good"), [s[1:] for s in SEQUENCES], ids=[s[0] for s in SEQUENCES])
def test_the_loss_scale_follows_gradscalers_rule(finite, scale, good):
    state = (loss_scale.LossScaleState(jnp.float32(scale), jnp.int32(good)), ())
    step = jax.jit(loss_scale.adjusted)
    for ok in finite:
        state = step(state, jnp.asarray(ok))
    expected = _reference(finite, scale, good)
    assert (float(state[0].scale), int(state[0].good_steps)) == expected


@pytest.mark.parametrize("compute_dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_gradients_of_a_narrow_forward_pass_are_all_reduced_in_the_parameters_dtype(compute_dtype):
    """The forward and backward pass in ``compute_dtype``; the gradient the engine sums comes back in float32 (the
    transpose of the cast), so the all-reduce carries float32 gradient bytes, as DDP under autocast does."""
    model = models.pytree()
    mesh = jddp.data_mesh(jax.devices()[:4])
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=mesh, compute_dtype=compute_dtype)
    state = dp.init(model.params, rng=0)
    report = dp.comm_report(state, models.batch(16))
    # The collectives the program asks for (before XLA:CPU widens narrow all-reduces).
    reduced = [c for c in report.lowered if c.op == "all-reduce"]
    dtypes = {dtype for c in reduced for dtype in c.dtypes}
    grad_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(model.params))
    assert "f32" in dtypes and not dtypes & {"bf16", "f16"}, report
    assert sum(c.nbytes for c in reduced) >= grad_bytes, report
