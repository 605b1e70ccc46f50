"""Adapters from Flax and Equinox models to jddp's ``loss_fn`` contract.

jddp trains any ``loss_fn(params, model_state, batch, rng) -> (loss,
(new_model_state, metrics))``. A plain pytree model writes that directly. For
Flax the split between trainable parameters and the rest (BatchNorm
statistics) is the library's:

* NNX: ``graphdef, params, model_state = jddp.models.nnx_split(model)``, then
  ``jddp.models.nnx_loss(graphdef, fn)`` where ``fn(model, batch, rng)``
  returns the loss, or ``(loss, metrics)``. Use ``nnx.BatchNorm(...,
  axis_name="data")`` for synchronised statistics (SyncBatchNorm).
* Linen: ``params, model_state = jddp.models.linen_split(variables)``, then
  ``jddp.models.linen_loss(module, fn)`` where ``fn(apply, batch, rng)`` calls
  ``apply(*inputs, **kwargs)`` in place of ``module.apply(variables, ...)``;
  every collection of ``model_state`` is mutable, and ``rng`` is passed as
  the ``"dropout"`` stream. Use ``nn.BatchNorm(axis_name="data")``.
* Equinox (``pip install jddp[equinox]``): ``static, params, model_state =
  jddp.models.eqx_split(*eqx.nn.make_with_state(Model)(...))``, then
  ``jddp.models.eqx_loss(static, fn)`` where ``fn(model, state, batch, key)``
  returns ``(loss, state)`` or ``(loss, state, metrics)``. BatchNorm's
  statistics over the whole global batch: ``eqx.nn.BatchNorm(...,
  axis_name=("batch", "data"), mode="batch")`` under ``jax.vmap(...,
  axis_name="batch")``.

Modes: ``nnx_loss`` runs the model in train mode (``model.train()``: dropout on,
BatchNorm on batch statistics) and ``nnx_eval`` in eval mode, whatever mode the
model was in when it was split. Linen modules take their mode as an argument
of ``apply`` (``train=True``), which ``fn`` passes.

Randomness: jddp's ``rng`` differs at every step; with ``DataParallel(rng="example")`` (the default) each
example's draws are those it would get on one device, on any device layout (``jddp.engine.rng``). An NNX
model that holds ``nnx.Rngs`` (``nnx.Dropout(rate, rngs=rngs)``, the usual NNX
style) keeps them: ``nnx_split`` stores their keys as raw key data in
``model_state`` (so that the state is arrays, broadcast, digested and saved like
any other), and at every step ``nnx_loss`` replaces each stream's key by one
drawn from jddp's ``rng`` and the stream's path, and its counter by 0. So every
layer, example and step gets its own masks, a run is reproducible and resumes
exactly, and the streams in ``model_state`` never change (they do not advance
as a plain NNX loop's would: a per-device counter could not be kept replicated).
A ``fn`` that uses ``rng`` itself must split it between layers: the same key
gives the same mask.

Back from a ``TrainState``: ``nnx_module(graphdef, state)`` is the trained NNX
module on the host (eval mode), ``linen_variables(state)`` the Linen variables,
``to_host(tree)`` any part of a state as NumPy; each process reads its own
replica, with no communication. A module built with ``axis_name="data"``
(synchronised BatchNorm) runs outside jddp in eval mode only.

Modules: ``nnx_adapter``, ``linen_adapter`` and ``eqx_adapter`` (one library's adapters each), ``host``
(``to_host``) and ``checks`` (what the adapters refuse, and how they say it).
"""

from jddp.models.checks import ADAPTERS as ADAPTERS
from jddp.models.checks import GRAPHDEF_PART as GRAPHDEF_PART
from jddp.models.checks import LIBRARIES as LIBRARIES
from jddp.models.checks import STATIC_PART as STATIC_PART
from jddp.models.eqx_adapter import eqx_eval as eqx_eval
from jddp.models.eqx_adapter import eqx_loss as eqx_loss
from jddp.models.eqx_adapter import eqx_module as eqx_module
from jddp.models.eqx_adapter import eqx_split as eqx_split
from jddp.models.host import to_host as to_host
from jddp.models.linen_adapter import linen_loss as linen_loss
from jddp.models.linen_adapter import linen_split as linen_split
from jddp.models.linen_adapter import linen_variables as linen_variables
from jddp.models.nnx_adapter import nnx_eval as nnx_eval
from jddp.models.nnx_adapter import nnx_loss as nnx_loss
from jddp.models.nnx_adapter import nnx_module as nnx_module
from jddp.models.nnx_adapter import nnx_split as nnx_split

__all__ = [
    "ADAPTERS",
    "GRAPHDEF_PART",
    "LIBRARIES",
    "STATIC_PART",
    "eqx_eval",
    "eqx_loss",
    "eqx_module",
    "eqx_split",
    "linen_loss",
    "linen_split",
    "linen_variables",
    "nnx_eval",
    "nnx_loss",
    "nnx_module",
    "nnx_split",
    "to_host",
]
