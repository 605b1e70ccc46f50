"""How a leaf of sharded optimizer state is stored: which dimension is split over ``"data"``, and its padding.

``DataParallel(shard_optimizer=True)`` (ZeRO-1) keeps each optimizer-state leaf
split over the devices. jax splits a dimension only into equal parts, so each
leaf is split along its largest dimension that the device count ``N`` divides,
stored as it is. A leaf none of whose dimensions ``N`` divides (an odd output
layer; every 512-wide layer on 6 devices) is zero-padded along its largest
dimension to the next multiple of ``N`` and split there: each device holds
``ceil(d / N)`` of its ``d`` rows, so its state still falls as ``1/N``, for
at most ``N - 1`` rows of padding. Scalars and leaves of one element (Adam's
step count) stay replicated.

Padding along an existing dimension, not flattening, keeps the shapes the
optimizer sees: inside the step the padding is sliced off (a slice of the
leading part of a dimension split with exactly this padding stays on each
device: no data moves), so optax sees every leaf with its parameter's shape.
Masks keyed on ``ndim`` (no weight decay on biases), factored second moments
(Adafactor) and per-leaf norms (LAMB, LARS) keep their meaning, and XLA adds
whatever collective a transform that is not elementwise needs. Flattening all
leaves into one buffer (DeepSpeed's ZeRO) would give every leaf one shape and
silently change those optimizers.

The padding of a leaf depends on ``N``; a checkpoint records the logical
shapes (``TrainState.opt_layout``) and ``jddp.Checkpointer`` restores onto any
other device count, or into the replicated engine, by truncating or padding.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jddp.runtime.mesh import DATA_AXIS


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """The storage of one optimizer-state leaf over ``num_devices`` devices.

    Attributes:
      shape: the logical shape, the one the optimizer sees.
      axis: the dimension split over ``"data"``, or None for a replicated leaf.
      stored: that dimension's size as stored: ``shape[axis]`` rounded up to a multiple of the device count
        (equal to it when the count divides it).
    """

    shape: tuple[int, ...]
    axis: int | None = None
    stored: int = 0

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if self.axis is None:
            return self.shape
        return (*self.shape[: self.axis], self.stored, *self.shape[self.axis + 1 :])

    @property
    def padded(self) -> bool:
        return self.axis is not None and self.stored != self.shape[self.axis]

    def spec(self) -> PartitionSpec:
        if self.axis is None:
            return PartitionSpec()
        return PartitionSpec(*(DATA_AXIS if i == self.axis else None for i in range(len(self.shape))))

    def pad(self, x: jax.Array) -> jax.Array:
        """The logical value ``x`` as stored: zeros appended along ``axis``."""
        if not self.padded:
            return x
        assert self.axis is not None
        widths = [(0, 0)] * x.ndim
        widths[self.axis] = (0, self.stored - self.shape[self.axis])
        return jnp.pad(x, widths)

    def unpad(self, x: jax.Array) -> jax.Array:
        """The stored value ``x`` as the optimizer sees it: the padding sliced off."""
        if not self.padded:
            return x
        assert self.axis is not None
        return lax.slice_in_dim(x, 0, self.shape[self.axis], axis=self.axis)


def choose(shape: tuple[int, ...], num_devices: int) -> LeafLayout:
    """The layout of a leaf of ``shape`` over ``num_devices``: its largest dimension that the count divides (the
    first of equals), else its largest dimension padded; replicated for one device, scalars and single elements."""
    shape = tuple(int(d) for d in shape)
    if num_devices == 1 or math.prod(shape) <= 1:
        return LeafLayout(shape)
    divisible = [i for i, d in enumerate(shape) if d % num_devices == 0]
    candidates = divisible or range(len(shape))
    axis = max(candidates, key=lambda i: (shape[i], -i))
    return LeafLayout(shape, axis, -(-shape[axis] // num_devices) * num_devices)
