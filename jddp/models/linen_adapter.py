"""The adapters of Flax Linen modules: ``linen_split``, ``linen_loss``, ``linen_variables``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn

from jddp import typing as jt
from jddp import validate
from jddp.models import checks
from jddp.models import host as host_lib
from jddp.runtime import state as state_lib


def linen_split(variables: Mapping) -> tuple[dict, dict]:
    """Splits Linen ``variables`` into ``(params, model_state)``.

    Raises:
      TypeError: ``variables`` is not a mapping with ``"params"`` (what ``module.init`` returns).
    """
    checks.check_of("linen_split", "variables", variables, "linen", Mapping, "the variables of module.init (a mapping)")
    if "params" not in variables:
        raise TypeError(
            "`linen_split`'s `variables` must hold the collection 'params' (the variables of module.init), got a "
            f"mapping with the keys {sorted(map(str, variables))}."
        )
    variables = dict(variables)
    return variables.pop("params"), variables


def linen_loss(module, fn: Callable[[Callable, jt.Batch, Any], Any], *, rng_name: str = "dropout") -> jt.LossFn:
    """A jddp ``loss_fn`` from ``fn(apply, batch, rng) -> loss | (loss, metrics)``.

    Raises:
      TypeError: ``module`` is not a Linen module, ``fn`` not a function or ``rng_name`` not a str.
    """
    checks.check_of("linen_loss", "module", module, "linen", nn.Module, "a flax.linen.Module")
    checks.check_fn("linen_loss", fn, "fn(apply, batch, rng) -> loss | (loss, metrics)")
    validate.check_str("rng_name", rng_name)

    def loss_fn(params, model_state, batch, rng):
        updated = dict(model_state)

        def apply(*args, **kwargs):
            variables = {"params": params, **updated}
            if not updated:
                return module.apply(variables, *args, rngs={rng_name: rng}, **kwargs)
            out, new = module.apply(variables, *args, rngs={rng_name: rng}, mutable=list(updated), **kwargs)
            updated.update(new)
            return out

        loss, metrics = checks.loss_and_metrics(fn(apply, batch, rng))
        return loss, (updated, metrics)

    return loss_fn


def linen_variables(state: state_lib.TrainState) -> dict:
    """The Linen variables of ``state`` on the host: ``module.apply(linen_variables(state), x, train=False)``.

    Raises:
      TypeError: ``state`` is not a live ``TrainState``.
    """
    checks.check_train_state("linen_variables", state)
    return {"params": host_lib.to_host(state.params), **host_lib.to_host(state.model_state)}
