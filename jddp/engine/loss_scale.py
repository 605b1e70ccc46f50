"""Dynamic loss scaling for float16 compute (PyTorch's ``GradScaler``), kept in the optimizer state.

float16 holds numbers up to 65504 and down to about 6e-8 (6e-5 at full
precision): small gradients of a float16 backward pass round to zero. The
loss is multiplied by a scale before differentiation, so that the gradients
are scaled as well, and the all-reduced gradient is divided by it again in
float32. A step whose gradient overflows (a non-finite norm) is skipped by
the engine's non-finite guard and halves the scale; ``GROWTH_INTERVAL``
finite steps in a row double it (``GradScaler``'s defaults: 2**16, x2 every
2000 steps, /2 on overflow).

The scale lives in the optimizer state (``with_loss_scale`` wraps the
optimizer: its state is ``(LossScaleState, inner state)``), so it is
replicated, checkpointed and restored with the rest of the training state, and
every replica takes the same decision from the same all-reduced gradient norm.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 2000
MAX_SCALE = 2.0**24  # float32's exact integers: beyond it doubling gains nothing
MIN_SCALE = 1.0


class LossScaleState(NamedTuple):
    """The current scale and the finite steps taken at it."""

    scale: jax.Array
    good_steps: jax.Array


def with_loss_scale(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` whose state also holds the loss scale; ``update`` passes through to ``inner``."""

    def init(params):
        state = LossScaleState(jnp.asarray(INITIAL_SCALE, jnp.float32), jnp.zeros((), jnp.int32))
        return state, inner.init(params)

    def update(updates, state, params=None):
        scale_state, inner_state = state
        updates, inner_state = inner.update(updates, inner_state, params)
        return updates, (scale_state, inner_state)

    return optax.GradientTransformation(init, update)


def scale_of(opt_state) -> jax.Array:
    """The current loss scale of a ``with_loss_scale`` optimizer state."""
    return opt_state[0].scale


def adjusted(opt_state, finite: jax.Array):
    """The state after a step: the scale halved after a non-finite gradient, doubled after ``GROWTH_INTERVAL``
    finite steps in a row."""
    state, inner_state = opt_state
    good = jnp.where(finite, state.good_steps + 1, 0)
    grow = good >= GROWTH_INTERVAL
    scale = jnp.where(
        finite,
        jnp.where(grow, jnp.minimum(state.scale * 2, MAX_SCALE), state.scale),
        jnp.maximum(state.scale / 2, MIN_SCALE),
    )
    return LossScaleState(scale.astype(state.scale.dtype), jnp.where(grow, 0, good).astype(jnp.int32)), inner_state
