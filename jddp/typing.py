"""Type aliases used across jddp (in one place, as chex does)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax

PyTree: TypeAlias = Any
Params: TypeAlias = PyTree
ModelState: TypeAlias = PyTree
Batch: TypeAlias = PyTree
Metrics: TypeAlias = Mapping[str, jax.Array]
# loss_fn(params, model_state, batch, rng) -> (loss, (new_model_state, aux_metrics))
LossFn: TypeAlias = Callable[[Params, ModelState, Batch, jax.Array], tuple[Any, tuple[ModelState, Metrics]]]
# eval_fn(params, model_state, batch) -> metrics
EvalFn: TypeAlias = Callable[[Params, ModelState, Batch], Metrics]
