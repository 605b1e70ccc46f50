"""The training state: a pytree of arrays only."""

from __future__ import annotations

import dataclasses

import jax

from jddp import typing as jt
from jddp.runtime.layout import LeafLayout


@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything that changes during training, replicated over the mesh.

    Attributes:
      step: int32 scalar, the number of steps taken (skipped ones included).
      params: the trainable parameters.
      opt_state: the optax optimizer state.
      model_state: non-trainable model variables (for example BatchNorm
        statistics); ``{}`` when the model has none.
      rng: ``uint32[2]`` raw key data (``jax.random.key_data``) of the base key;
        step ``s`` on device ``d`` uses ``fold_in(fold_in(key, s), d)``.
      opt_layout: not a leaf: ``None`` when ``opt_state`` is replicated; with
        ``DataParallel(shard_optimizer=True)``, one ``jddp.runtime.layout.LeafLayout``
        per leaf of ``opt_state`` (its logical shape, the dimension split over
        ``"data"`` and that dimension's padding), so that a checkpoint records
        logical shapes and restores onto other device counts.
    """

    step: jax.Array
    params: jt.Params
    opt_state: jt.PyTree
    model_state: jt.ModelState
    rng: jax.Array
    opt_layout: tuple[LeafLayout, ...] | None = None

    def replace(self, **changes) -> TrainState:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    TrainState,
    data_fields=["step", "params", "opt_state", "model_state", "rng"],
    meta_fields=["opt_layout"],
)
