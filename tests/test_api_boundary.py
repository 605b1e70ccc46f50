"""Every public callable of jddp refuses a wrong value for any of its parameters with a jddp error naming the
parameter, before it changes any state or file, or takes it as ``ACCEPTED`` documents.

The cases are generated: the callables by walking ``jddp`` with pkgutil (``__all__`` of every public module, the
public modules ``jddp.__all__`` names, the public methods of every class), the parameters by ``inspect.signature``
and the wrong values from each parameter's annotation, name and default. The hand-written parts are ``FACTORIES``
(one valid call per callable), ``NOT_CALLED`` (types jddp returns or raises, never called by users), ``ACCEPTED``
(wrong-looking values taken on purpose) and ``KNOWN`` (refusals still missing in files being edited by others,
with the fix). A callable added later without a factory fails ``test_every_public_callable_has_a_factory``.

A generated call ends in one of: accepted and listed in ``ACCEPTED``; or a ``ValueError``/``TypeError``/
``RuntimeError`` (or a jddp subclass) raised by jddp's own code whose message names the parameter, with no file
under the test's directories changed and no training state donated. Anything else is a finding: ``silent`` (a
wrong value taken), ``foreign`` (an error of JAX, NumPy, Orbax, OmegaConf or Python, or one not naming the
parameter), ``crash`` (an internal error: AttributeError, KeyError, ...), ``hang`` (no answer within
``TIMEOUT_S``) or ``changed`` (refused, but after changing a file or donating the state).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import itertools
import math
import pkgutil
import re
import signal
import traceback
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jddp
from jddp import config as config_lib
from jddp import models as jm
from jddp.runtime import standby
from tests import models

PACKAGE = Path(jddp.__file__).parent
TIMEOUT_S = 30
N = 16  # the global batch of the baseline calls
SKIPPED_MODULES = ("jddp.cli", "jddp.launch", "jddp.benchmark")  # tests/test_env_boundary.py walks their options

# ----------------------------------------------------------------- the public callables


def public_modules() -> list[types.ModuleType]:
    """``jddp`` and every public module below it with an ``__all__``, and those ``jddp.__all__`` names."""
    names = ["jddp"] + [m.name for m in pkgutil.walk_packages(jddp.__path__, "jddp.")]
    out = []
    for name in names:
        if any(part.startswith("_") for part in name.split(".")) or name.startswith(SKIPPED_MODULES):
            continue
        module = importlib.import_module(name)
        if hasattr(module, "__all__") or (name.rsplit(".", 1)[-1] in jddp.__all__ and name.count(".") == 1):
            out.append(module)
    return out


def exported(module: types.ModuleType) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [  # a public module without __all__ (jddp.config, jddp.models): what it defines itself
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__ and callable(v)
    ]


def public_callables() -> dict[str, Any]:
    """``{qualified name: callable}``: functions, classes (their constructor) and classes' public methods, each
    once, under the first public name found (``jddp.X`` before ``jddp.engine.X``)."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for module in public_modules():
        for name in exported(module):
            value = getattr(module, name)
            if isinstance(value, types.ModuleType) or not callable(value) or id(value) in seen:
                continue
            if isinstance(value, type) and issubclass(value, BaseException | Warning):
                continue  # raised, not called
            seen.add(id(value))
            qualified = f"{module.__name__}.{name}"
            found[qualified] = value
            if isinstance(value, type):
                for attr in dir(value):
                    static = inspect.getattr_static(value, attr)
                    function = getattr(static, "__func__", static)
                    if attr.startswith("_") or not inspect.isfunction(function):
                        continue
                    if not function.__module__.startswith("jddp"):
                        continue
                    found[f"{qualified}.{attr}"] = getattr(value, attr)
    return found


def parameters(fn) -> list[inspect.Parameter]:
    target = fn.__init__ if isinstance(fn, type) else fn
    params = list(inspect.signature(target).parameters.values())
    return [p for p in params if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


# ----------------------------------------------------------------- the session's objects: one compiled program


def loss_fn(params, model_state, batch, rng):
    return models.pytree().loss_fn(params, model_state, batch, rng)


def eval_fn(params, model_state, batch):
    return {"loss": jnp.mean(batch["x"] @ params["w1"])}


class Ctx:
    """What the factories build valid calls from: one DataParallel (compiled once), its state, a loader, models
    of the three libraries and a directory per call."""

    def __init__(self, root: Path):
        self.root = root
        self.model = models.pytree()
        self.mesh = jddp.data_mesh()
        self.dp = jddp.DataParallel(self.model.loss_fn, optax.sgd(0.1), mesh=self.mesh, eval_fn=eval_fn)
        self._state = None
        self.source = models.batch(64)
        self.saved = root / "saved"
        with jddp.Checkpointer(self.saved, config={"lr": 0.1}) as c:
            c.save(self.state(), wait=True)
        self.count = 0
        _, metrics = self.dp.step(self.state(), self.batch())
        self.metrics = metrics
        self._state = None
        self.nnx = models.NNXMLP(None, nnx.Rngs(0))
        self.linen = models.LinenMLP()
        self.variables = self.linen.init(jax.random.key(0), np.zeros((1, models.IN), np.float32))
        self.eqx = models.EqxMLP(jax.random.key(0))
        self.graphdef, nparams, nstate = jm.nnx_split(self.nnx)
        self.static, eparams, estate = jm.eqx_split(self.eqx)
        lparams, lstate = jm.linen_split(self.variables)
        plain = jddp.DataParallel(self.model.loss_fn, optax.sgd(0.1), mesh=self.mesh)
        self.nnx_state = plain.init(nparams, nstate)
        self.linen_state = plain.init(lparams, lstate)
        self.eqx_state = plain.init(eparams, estate)
        self.hlo = self.dp.comm_report(self.state(), self.batch())

    def state(self) -> jddp.TrainState:
        """The state to step: a new one when the last was donated."""
        if self._state is None or any(x.is_deleted() for x in jax.tree.leaves(self._state)):
            self._state = self.dp.init(self.model.params)
        return self._state

    def batch(self) -> dict:
        return models.batch(N)

    def fresh(self, name: str = "d") -> Path:
        self.count += 1
        return self.root / "calls" / f"{name}{self.count}"

    def loader(self, **kwargs) -> jddp.data.DataLoader:
        kwargs.setdefault("global_batch_size", N)
        return jddp.data.DataLoader(self.source, mesh=self.mesh, **kwargs)

    def checkpointer(self, **kwargs) -> jddp.Checkpointer:
        return jddp.Checkpointer(self.fresh("ckpt"), **kwargs)

    def sampler(self) -> jddp.data.DistributedBatchSampler:
        return jddp.data.DistributedBatchSampler(64, global_batch_size=N)


@dataclasses.dataclass
class Call:
    fn: Callable
    kwargs: dict
    cleanup: list = dataclasses.field(default_factory=list)  # objects to close afterwards


def closing(fn, obj, **kwargs) -> Call:
    return Call(fn, kwargs, [obj])


@dataclasses.dataclass(frozen=True)
class Schema:
    lr: float = 0.1


# One valid call per public callable: the only hand-written list of the API. A new callable fails
# test_every_public_callable_has_a_factory until it has one here.
FACTORIES: dict[str, Callable[[Ctx], Call]] = {
    "jddp.Checkpointer": lambda c: Call(jddp.Checkpointer, {"directory": c.fresh("ckpt")}),
    "jddp.Checkpointer.all_steps": lambda c: (k := c.checkpointer()) and closing(k.all_steps, k),
    "jddp.Checkpointer.close": lambda c: (k := c.checkpointer()) and Call(k.close, {}),
    "jddp.Checkpointer.latest_step": lambda c: (k := c.checkpointer()) and closing(k.latest_step, k),
    "jddp.Checkpointer.wait": lambda c: (k := c.checkpointer()) and closing(k.wait, k),
    "jddp.Checkpointer.maybe_save": lambda c: (
        (k := c.checkpointer(save_every=1)) and closing(k.maybe_save, k, state=c.state(), loader=c.loader(), extra=None)
    ),
    "jddp.Checkpointer.restore_or_init": lambda c: (
        (k := jddp.Checkpointer(c.saved, read_only=True))
        and closing(k.restore_or_init, k, state=c.state(), loader=None, extra=None)
    ),
    "jddp.Checkpointer.save": lambda c: (
        (k := c.checkpointer())
        and closing(k.save, k, state=c.state(), loader=c.loader(), wait=True, extra=jddp.RunningMeans())
    ),
    "jddp.CommReport.count": lambda c: Call(c.hlo.count, {"op": "all-reduce"}),
    "jddp.CommReport.nbytes": lambda c: Call(c.hlo.nbytes, {"op": "all-reduce"}),
    "jddp.CommReport.table": lambda c: Call(c.hlo.table, {}),
    "jddp.CommReport.wire_bytes": lambda c: Call(c.hlo.wire_bytes, {"op": "all-reduce"}),
    "jddp.CommReport.from_hlo": lambda c: Call(
        jddp.CommReport.from_hlo, {"hlo_text": "", "reduce_dtype": None, "lowered_text": None}
    ),
    "jddp.DataParallel": lambda c: Call(
        jddp.DataParallel, {"loss_fn": c.model.loss_fn, "optimizer": optax.sgd(0.1), "mesh": c.mesh}
    ),
    "jddp.DataParallel.assert_replicas_identical": lambda c: Call(c.dp.assert_replicas_identical, {"state": c.state()}),
    "jddp.DataParallel.check_replicas": lambda c: Call(c.dp.check_replicas, {"state": c.state()}),
    "jddp.DataParallel.comm_report": lambda c: Call(
        c.dp.comm_report, {"state": c.state(), "batch": c.batch(), "platform": "cuda"}
    ),
    "jddp.DataParallel.lower": lambda c: Call(
        c.dp.lower, {"state": c.state(), "batch": c.batch(), "platform": "tpu", "program": "eval"}
    ),
    "jddp.CommReport.from_lowered": lambda c: Call(
        jddp.CommReport.from_lowered, {"lowered_text": "", "platform": "cuda"}
    ),
    "jddp.CommReport.portability": lambda c: Call(c.hlo.portability, {}),
    "jddp.DataParallel.compile": lambda c: Call(c.dp.compile, {"state": c.state(), "batch": c.batch()}),
    "jddp.DataParallel.eval_step": lambda c: Call(c.dp.eval_step, {"state": c.state(), "batch": c.batch()}),
    "jddp.DataParallel.evaluate": lambda c: Call(c.dp.evaluate, {"state": c.state(), "batches": [c.batch()]}),
    "jddp.DataParallel.init": lambda c: Call(c.dp.init, {"params": c.model.params, "model_state": {}, "rng": 0}),
    "jddp.DataParallel.step": lambda c: Call(c.dp.step, {"state": c.state(), "batch": c.batch()}),
    "jddp.RunningMeans": lambda c: Call(jddp.RunningMeans, {"parent": None}),
    "jddp.RunningMeans.add": lambda c: Call(jddp.RunningMeans().add, {"metrics": c.metrics}),
    "jddp.RunningMeans.compute": lambda c: Call(jddp.RunningMeans().compute, {}),
    "jddp.RunningMeans.get_state": lambda c: Call(jddp.RunningMeans().get_state, {}),
    "jddp.RunningMeans.get_state_later": lambda c: Call(jddp.RunningMeans().get_state_later, {}),
    "jddp.RunningMeans.reset": lambda c: Call(jddp.RunningMeans().reset, {}),
    "jddp.RunningMeans.set_state": lambda c: Call(jddp.RunningMeans().set_state, {"state": running_state(c)}),
    "jddp.TrainState": lambda c: Call(jddp.TrainState, state_fields(c.state())),
    "jddp.TrainState.replace": lambda c: Call(c.state().replace, {}),
    "jddp.Weighted": lambda c: Call(jddp.Weighted, {"total": jnp.float32(3.0), "weight": jnp.float32(2.0)}),
    "jddp.average_gradients": lambda c: Call(jddp.average_gradients, {}),
    "jddp.data_parallel": lambda c: Call(
        jddp.data_parallel, {"fn": lambda state, batch: state, "batch_argnums": 1, "mesh": c.mesh, "rng": None}
    ),
    "jddp.register_flush": lambda c: Call(jddp.register_flush, {"f": io.StringIO()}),
    "jddp.global_mean": lambda c: Call(jddp.global_mean, {"tree": {"a": jnp.ones(2)}}),
    "jddp.barrier": lambda c: Call(jddp.barrier, {"name": "probe", "timeout_s": 5.0}),
    "jddp.batch_sharding": lambda c: Call(jddp.batch_sharding, {"mesh": c.mesh}),
    "jddp.data_mesh": lambda c: Call(jddp.data_mesh, {"devices": jax.devices()[:4]}),
    "jddp.fit": lambda c: Call(
        jddp.fit,
        {
            "dp": c.dp,
            "state": c.state(),
            "train_loader": c.loader(),
            "steps": 1,
            "log_dir": c.fresh("logs"),
            "log_every": 1,
            "progress": False,
            "replica_check_every": None,
        },
    ),
    "jddp.heartbeat": lambda c: Call(jddp.heartbeat, {"step": 3}),
    "jddp.host_all_gather": lambda c: Call(jddp.host_all_gather, {"value": 3, "timeout_s": 5.0}),
    "jddp.host_all_reduce": lambda c: Call(jddp.host_all_reduce, {"value": 3.0, "op": "sum", "timeout_s": 5.0}),
    "jddp.host_broadcast": lambda c: Call(jddp.host_broadcast, {"value": 3, "timeout_s": 5.0}),
    "jddp.initialize": lambda c: Call(jddp.initialize, {"local_devices": 8, "verbose": False}),
    "jddp.is_main_process": lambda c: Call(jddp.is_main_process, {}),
    "jddp.masked_mean": lambda c: Call(jddp.masked_mean, {"values": jnp.ones(4), "mask": jnp.ones(4)}),
    "jddp.phase": lambda c: Call(jddp.phase, {"name": "probe"}),
    "jddp.process_count": lambda c: Call(jddp.process_count, {}),
    "jddp.process_index": lambda c: Call(jddp.process_index, {}),
    "jddp.replicated": lambda c: Call(jddp.replicated, {"mesh": c.mesh}),
    "jddp.simulate_cpu_devices": lambda c: Call(jddp.simulate_cpu_devices, {"n": 8}),
    "jddp.runtime.standby.active": lambda c: Call(standby.active, {}),
    "jddp.runtime.standby.on_wake": lambda c: Call(standby.on_wake, {"callback": lambda: None}),
    "jddp.runtime.standby.wait": lambda c: Call(standby.wait, {}),
    "jddp.runtime.standby.before_standing_by": lambda c: Call(standby.before_standing_by, {"callback": lambda: None}),
    "jddp.runtime.standby.offer_batch": lambda c: Call(standby.offer_batch, {"source": lambda: None}),
    "jddp.checkpoint.config_fingerprint": lambda c: Call(jddp.checkpoint.config_fingerprint, {"config": {"lr": 0.1}}),
    "jddp.checkpoint.digest_array": lambda c: Call(
        jddp.checkpoint.digest_array, {"tree": c.state().params, "layouts": None}
    ),
    "jddp.checkpoint.state_digests": lambda c: Call(
        jddp.checkpoint.state_digests, {"tree": c.state().params, "layouts": None}
    ),
    "jddp.data.DataLoader": lambda c: Call(
        jddp.data.DataLoader, {"source": c.source, "global_batch_size": N, "mesh": c.mesh}
    ),
    "jddp.data.Buckets": lambda c: Call(jddp.data.Buckets, {"boundaries": (2, 4), "length": "n", "pad": {"t": 0}}),
    "jddp.data.DataLoader.close": lambda c: Call(c.loader().close, {}),
    "jddp.data.DataLoader.examples_at": lambda c: closing((k := c.loader()).examples_at, k, step=1),
    "jddp.data.DataLoader.set_epoch": lambda c: closing((k := c.loader()).set_epoch, k, epoch=1),
    "jddp.data.DataLoader.steps": lambda c: closing((k := c.loader()).steps, k, epochs=2),
    "jddp.data.DataLoader.get_state": lambda c: closing((k := c.loader()).get_state, k),
    "jddp.data.DataLoader.local_batches": lambda c: closing((k := c.loader()).local_batches, k),
    "jddp.data.DataLoader.set_state": lambda c: closing((k := c.loader()).set_state, k, state=c.loader().get_state()),
    "jddp.data.DataLoader.skip": lambda c: closing((k := c.loader()).skip, k, batches=1, timeout_s=5.0),
    "jddp.data.DataLoader.to_global": lambda c: closing(
        (k := c.loader()).to_global, k, local=next(iter(k.local_batches()))
    ),
    "jddp.data.DistributedBatchSampler": lambda c: Call(
        jddp.data.DistributedBatchSampler,
        {"dataset_size": 64, "global_batch_size": N, "num_replicas": 1, "rank": 0, "seed": 0},
    ),
    "jddp.data.DistributedBatchSampler.examples_at": lambda c: Call(c.sampler().examples_at, {"step": 1}),
    "jddp.data.DistributedBatchSampler.global_batch": lambda c: Call(c.sampler().global_batch, {"position": 1}),
    "jddp.data.DistributedBatchSampler.load_state_dict": lambda c: Call(
        c.sampler().load_state_dict, {"state": c.sampler().state_dict()}
    ),
    "jddp.data.DistributedBatchSampler.local_batch": lambda c: Call(c.sampler().local_batch, {"position": 1}),
    "jddp.data.DistributedBatchSampler.local_block": lambda c: Call(
        c.sampler().local_block, {"position": 1, "count": 2}
    ),
    "jddp.data.DistributedBatchSampler.order": lambda c: Call(c.sampler().order, {"epoch": 1}),
    "jddp.data.DistributedBatchSampler.position_of_step": lambda c: Call(c.sampler().position_of_step, {"step": 1}),
    "jddp.data.DistributedBatchSampler.set_epoch": lambda c: Call(c.sampler().set_epoch, {"epoch": 1}),
    "jddp.data.DistributedBatchSampler.skip": lambda c: Call(c.sampler().skip, {"batches": 1}),
    "jddp.data.DistributedBatchSampler.state_dict": lambda c: Call(c.sampler().state_dict, {}),
    "jddp.config.run_field": lambda c: Call(config_lib.run_field, {"default": "run"}),
    "jddp.config.parse": lambda c: Call(config_lib.parse, {"schema": Schema, "argv": ["lr=0.5"], "path": None}),
    "jddp.config.to_yaml": lambda c: Call(config_lib.to_yaml, {"config": Schema()}),
    "jddp.config.save": lambda c: Call(config_lib.save, {"config": Schema(), "path": c.fresh("config") / "c.yaml"}),
    "jddp.models.nnx_split": lambda c: Call(jm.nnx_split, {"model": c.nnx}),
    "jddp.models.nnx_loss": lambda c: Call(jm.nnx_loss, {"graphdef": c.graphdef, "fn": nnx_fn}),
    "jddp.models.nnx_eval": lambda c: Call(jm.nnx_eval, {"graphdef": c.graphdef, "fn": nnx_fn}),
    "jddp.models.nnx_module": lambda c: Call(jm.nnx_module, {"graphdef": c.graphdef, "state": c.nnx_state}),
    "jddp.models.linen_variables": lambda c: Call(jm.linen_variables, {"state": c.linen_state}),
    "jddp.models.to_host": lambda c: Call(jm.to_host, {"tree": c.state().params}),
    "jddp.models.linen_split": lambda c: Call(jm.linen_split, {"variables": c.variables}),
    "jddp.models.linen_loss": lambda c: Call(jm.linen_loss, {"module": c.linen, "fn": nnx_fn, "rng_name": "dropout"}),
    "jddp.models.eqx_split": lambda c: Call(jm.eqx_split, {"model": c.eqx, "state": None}),
    "jddp.models.eqx_loss": lambda c: Call(jm.eqx_loss, {"static": c.static, "fn": nnx_fn}),
    "jddp.models.eqx_eval": lambda c: Call(jm.eqx_eval, {"static": c.static, "fn": nnx_fn}),
    "jddp.models.eqx_module": lambda c: Call(jm.eqx_module, {"static": c.static, "state": c.eqx_state}),
}

# Types jddp returns or raises: users read them, never build them (exceptions and warnings are left out by the
# walk). Their public methods have factories all the same.
NOT_CALLED = {
    "jddp.CommReport": "returned by DataParallel.comm_report and CommReport.from_hlo",
    "jddp.FitResult": "returned by jddp.fit",
    "jddp.Metrics": "returned by DataParallel.step and eval_step",
    "jddp.ProcessGroup": "returned by jddp.initialize",
    "jddp.data.LocalBatch": "returned by DistributedBatchSampler.local_batch",
}


def nnx_fn(model, batch, rng):
    return jnp.float32(0.0), {}


def running_state(c: Ctx) -> dict:
    means = jddp.RunningMeans()
    means.add(c.metrics)
    return means.get_state()


def state_fields(state) -> dict:
    return {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}


# ----------------------------------------------------------------- wrong values, from a parameter's annotation


def kind_of(name: str, annotation: str, default) -> str:
    """What a parameter takes, read from its annotation and name."""
    a = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    if a.startswith("Literal") or "Literal[" in a:
        return "choice"
    if "TrainState" in a or (name == "state" and "dict" not in a):
        return "state"
    if "PathLike" in a or name in ("directory", "path", "log_dir") or a == "Path":
        return "path"
    if "Mesh" in a:
        return "mesh"
    if "DataParallel" in a:
        return "dp"
    if "DataLoader" in a:
        return "loader"
    if "Checkpointer" in a:
        return "checkpointer"
    if "GraphDef" in a:
        return "graphdef"
    if "nnx.Module" in a:
        return "nnx"
    if name == "module":
        return "linen"
    if name == "static":
        return "static"
    if name == "model":
        return "eqx"
    if name in ("variables",):
        return "mapping"
    if "Batch" in a or name in ("batch", "local"):
        return "batch"
    if "Iterable" in a or (name == "batches" and "int" not in a):
        return "iterable"
    if "Callable" in a or "LossFn" in a or "EvalFn" in a or "Transform" in a or name.endswith("fn"):
        return "callable"
    if "GradientTransformation" in a:
        return "optimizer"
    if a.replace(" | None", "") == "bool":
        return "bool"
    if a.replace(" | None", "") in ("int",):
        return "int"
    if a.replace(" | None", "") in ("float", "int | float"):
        return "float"
    if "tuple[int, int]" in a:
        return "pair"
    if a.replace(" | None", "") == "str":
        return "str"
    if "jax.Array" in a or "np.ndarray" in a:
        return "array"
    if "Metrics" in a:
        return "metrics"
    if a.replace(" | None", "") in ("dict", "dict[str, Any]") or a.startswith("Mapping"):
        return "mapping"
    if "Sequence[str]" in a or "list[str]" in a:
        return "argv"
    if a.startswith("type["):
        return "schema"
    if name in ("layouts", "devices"):
        return "list"
    return "any"


def optional(p: inspect.Parameter) -> bool:
    a = str(p.annotation)
    return "None" in a or p.default is None or (a in ("Any", "inspect._empty") and p.default is not p.empty)


def deleted_array():
    x = jnp.ones(N)
    x.delete()
    return x


def wrong_values(kind: str, p: inspect.Parameter, valid, c: Ctx) -> list[tuple[str, Any]]:
    """``(value kind, value)``: the family of wrong values for a parameter of ``kind`` whose valid value is
    ``valid``."""
    out: list[tuple[str, Any]] = []
    if not optional(p):
        out.append(("None", None))
    number = valid if isinstance(valid, int | float) and not isinstance(valid, bool) else 1
    if kind in ("int", "float"):
        out += [
            ("bool", True),
            ("str-number", str(number)),
            ("str-false", "False"),
            ("nan", math.nan),
            ("inf", math.inf),
            ("-inf", -math.inf),
            ("negative", -1 if kind == "int" else -1.0),
            ("zero", 0 if kind == "int" else 0.0),
            ("complex", 1j),
            ("numpy-scalar", np.int64(number) if kind == "int" else np.float32(number)),
            ("jax-scalar", jnp.asarray(number)),
            ("list", [number]),
        ]
        if kind == "int":
            out += [("fraction", 2.5), ("integral-float", float(number))]
    elif kind == "bool":
        out += [
            ("str-false", "False"),
            ("str-no", "no"),
            ("str-zero", "0"),
            ("int", 1),
            ("int-zero", 0),
            ("float", 1.0),
            ("numpy-scalar", np.bool_(bool(valid))),
            ("jax-scalar", jnp.asarray(bool(valid))),
        ]
    elif kind == "str":
        out += [("int", 3), ("bytes", b"x"), ("empty", ""), ("numpy-scalar", np.str_(valid or "x")), ("list", [valid])]
    elif kind == "choice":
        out += [("typo", f"{valid}s"), ("upper", str(valid).upper()), ("int", 1), ("empty", ""), ("list", [valid])]
    elif kind == "path":
        missing = c.root / "no-such-parent" / "typo"
        a_file = c.root / "a-file"
        a_file.write_text("x")
        out += [("int", 3), ("empty", ""), ("bytes", b"d"), ("file", a_file), ("missing-parent", missing)]
        out += [("list", [str(valid)]), ("tilde", "~no-such-user-jddp/x")]
    elif kind == "callable":
        out += [("not-callable", 3), ("string", "loss_fn"), ("dict", {"fn": nnx_fn})]
    elif kind == "state":
        s = c.state()
        out += [
            ("dict", state_fields(s)),
            ("params", s.params),
            ("numpy-copy", jax.tree.map(np.asarray, s)),
            ("other-library", c.nnx),
            ("empty", {}),
        ]
    elif kind == "batch":
        b = c.batch()
        out += [
            ("empty", {}),
            ("wrong-rank", {k: v[0] for k, v in b.items()}),
            ("string-dtype", {**b, "y": np.array(["a"] * N)}),
            ("deleted", {"x": deleted_array(), "y": b["y"]}),
            ("odd-size", {k: v[:3] for k, v in b.items()}),
            ("mismatched-sizes", {"x": b["x"], "y": b["y"][:8]}),
            ("list-of-examples", [b]),
            ("string", "batch"),
        ]
    elif kind == "iterable":
        out += [("batch", c.batch()), ("int", 3), ("string", "batches")]
    elif kind == "array":
        out += [
            ("wrong-rank", jnp.ones((2, 2, 2))),
            ("string-dtype", np.array(["a", "b"])),
            ("deleted", deleted_array()),
            ("list", [1.0, 2.0]),
            ("numpy-copy", np.ones(4, np.float32)),
            ("string", "x"),
        ]
    elif kind == "mesh":
        out += [("devices", jax.devices()), ("string", "data"), ("sharding", jddp.replicated(c.mesh))]
        out += [("other-axis", jax.sharding.Mesh(np.array(jax.devices()), ("x",)))]
    elif kind == "dp":
        out += [("string", "dp"), ("optimizer", optax.sgd(0.1))]
    elif kind == "loader":
        out += [("list-of-batches", [c.batch()]), ("source", c.source), ("sampler", c.sampler())]
    elif kind == "checkpointer":
        out += [("path", str(c.fresh("ckpt"))), ("string", "ckpt")]
    elif kind == "optimizer":
        out += [("schedule", optax.constant_schedule(0.1)), ("float", 0.1), ("optax-module", optax)]
    elif kind in ("nnx", "linen", "eqx", "static", "graphdef"):
        others = {"nnx": c.nnx, "linen": c.linen, "eqx": c.eqx, "static": c.static, "graphdef": c.graphdef}
        library = {"nnx": "nnx", "graphdef": "nnx", "linen": "linen", "eqx": "eqx", "static": "eqx"}
        for k, v in others.items():
            if library[k] != library[kind]:
                out.append((f"other-library-{k}", v))
        out += [("params", c.model.params), ("string", "model")]
    elif kind == "mapping":
        out += [("list", [1, 2]), ("string", "state"), ("int", 3), ("other-library-nnx", c.nnx)]
    elif kind == "metrics":
        out += [("dict", {"loss": 1.0}), ("string", "loss")]
    elif kind == "pair":
        out += [
            ("int", 3),
            ("triple", (1, 2, 3)),
            ("reversed", (5, 2)),
            ("negative", (-2, -1)),
            ("strings", ("1", "2")),
        ]
    elif kind == "argv":
        out += [("string", "lr=0.5"), ("int", 3), ("list-of-ints", [1])]
    elif kind == "schema":
        out += [("instance", Schema()), ("dict", dict), ("string", "Schema")]
    elif kind == "list":
        out += [("int", 3), ("string", "cpu"), ("empty", [])]
    else:  # any: only what no value of any kind can be
        out += [("object", object()), ("generator", (i for i in range(3)))]
    return out


def with_tuple(call: Call, params: list[inspect.Parameter]) -> list[tuple[str, str, Any]]:
    """``(parameter, "tuple-of-args", value)``: a parameter given the tuple of its own and the next
    parameter's valid values (``f((a, b))`` for ``f(a, b)``), the next left valid."""
    out = []
    for p, q in itertools.pairwise(params):
        if p.name in call.kwargs and q.name in call.kwargs and q.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            out.append((p.name, "tuple-of-args", (call.kwargs[p.name], call.kwargs[q.name])))
    return out


# ----------------------------------------------------------------- what a generated call may end in

# Wrong-looking values taken on purpose: (callable or "*", parameter or "*", value kind) -> why.
ACCEPTED: dict[tuple[str, str, str], str] = {
    ("*", "*", "numpy-scalar"): "a NumPy scalar is the Python value it holds (validate.check_int takes np.integer, "
    "check_number np.floating, check_bool np.bool_): what `arr.max()` or a NumPy config gives",
    ("jddp.Checkpointer", "directory", "missing-parent"): "the directory is created with its parents (documented)",
    ("jddp.fit", "log_dir", "missing-parent"): "the log directory is created with its parents",
    ("jddp.config.save", "path", "missing-parent"): "the file's directory is created with its parents",
    ("jddp.config.save", "path", "file"): "an existing file is replaced (atomically): a rerun rewrites its config.yaml",
    ("jddp.config.run_field", "default", "None"): "a config field may default to None (`devices: int | None`)",
    ("jddp.data.Buckets", "length", "string"): "any name of a field: the source is not known yet; DataLoader refuses a "
    "name the source lacks, naming its fields",
    ("jddp.data.DataLoader", "worker_count", "zero"): "0 workers: the batches are read in this process (documented)",
    ("jddp.data.DataLoader", "prefetch", "zero"): "0: nothing read ahead, a block is read when it is due (documented)",
    ("jddp.models.to_host", "tree", "*"): "any pytree: its array leaves are copied to the host, others kept",
    ("jddp.host_all_gather", "value", "tuple-of-args"): "any picklable value: a tuple is one",
    ("jddp.host_broadcast", "value", "tuple-of-args"): "any picklable value: a tuple is one",
    ("jddp.host_all_gather", "value", "object"): "any picklable value: object() pickles",
    ("jddp.host_broadcast", "value", "object"): "any picklable value: object() pickles",
    ("jddp.DataParallel.init", "params", "tuple-of-args"): "params are any pytree of float arrays: a tuple is one",
    ("jddp.DataParallel.init", "model_state", "tuple-of-args"): "the model state is any pytree of arrays",
    ("*", "epoch", "zero"): "epochs count from 0",
    ("*", "step", "zero"): "steps count from 0",
    ("*", "position", "zero"): "positions count from 0",
    ("*", "rank", "zero"): "ranks count from 0",
    ("*", "seed", "zero"): "0 is a seed",
    ("jddp.Checkpointer", "preemption_check_s", "zero"): "0: the preemption flag is read at every maybe_save",
    ("jddp.host_all_gather", "value", "None"): "any picklable value: None is one",
    ("jddp.host_broadcast", "value", "None"): "any picklable value: None is one",
    ("jddp.DataParallel.evaluate", "batches", "list-of-examples"): "a list of batches is what `batches` is: the "
    "generated list holds one whole batch",
    ("jddp.TrainState", "params", "tuple-of-args"): "params are any pytree of arrays: a tuple is one",
    ("jddp.TrainState", "opt_state", "tuple-of-args"): "the optimizer state is any pytree of arrays: a tuple is one",
    ("jddp.TrainState", "model_state", "tuple-of-args"): "the model state is any pytree of arrays: a tuple is one",
    ("jddp.masked_mean", "*", "numpy-copy"): "a NumPy array is an array: masked_mean takes them as jnp functions do",
    ("jddp.replicated", "mesh", "other-axis"): "held whole on every device of any mesh: the data axis is not used",
    ("jddp.checkpoint.digest_array", "tree", "tuple-of-args"): "any pytree of jax.Arrays: a tuple is one",
    ("jddp.checkpoint.state_digests", "tree", "tuple-of-args"): "any pytree of jax.Arrays: a tuple is one",
    ("jddp.CommReport.from_hlo", "*", "empty"): "a program text without collectives gives an empty report, an empty "
    "text too (the factory's own call)",
    ("jddp.CommReport.from_lowered", "*", "empty"): "a lowered text without collectives gives an empty report, as "
    "from_hlo does",
    ("jddp.fit", "log_every", "None"): "None: one training record, at the last step (documented in fit's Args)",
}

# Refusals still missing where this test may not fix them (files being edited by others): the finding and the
# fix. Each entry must still fail: when fixed, the test says to drop it.
KNOWN: dict[tuple[str, str, str], str] = {}

# Callables whose generated calls kill the process (a segfault in XLA): not run until fixed, the reason says what.
KILLS_THE_PROCESS: dict[str, str] = {}

# Callables whose generated calls still find something (class: count), with where the fix goes. The test of each
# is an expected failure (strict): when its findings are fixed it passes, and the entry must go.
PENDING: dict[str, str] = {
    # files being edited by others right now (see the report of the change that added this test)
    # not yet fixed (time): the fix in each
}

# OSError: a path that is a file where a directory is wanted (NotADirectoryError), raised by jddp naming it.
ALLOWED = (ValueError, TypeError, RuntimeError, OSError)
CRASHES = (
    AttributeError,
    KeyError,
    IndexError,
    ZeroDivisionError,
    AssertionError,
    NameError,
    RecursionError,
    OverflowError,
    UnboundLocalError,
    StopIteration,
    NotImplementedError,
)


class Hang(BaseException):
    pass


class Reached(BaseException):
    """A side effect the test does not let happen (joining a process group): the value was taken."""


def accepted(name: str, param: str, kind: str) -> str | None:
    for key in ((name, param, kind), (name, param, "*"), (name, "*", kind), ("*", param, kind), ("*", "*", kind)):
        if key in ACCEPTED:
            return ACCEPTED[key]
    return None


def raised_in_jddp(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(PACKAGE.resolve())


def names(message: str, param: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(param)}(?!\w)", message) is not None


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.name != "jddp.lease" and p.exists()
    }


def run_once(fn, kwargs):
    def on_alarm(*_):
        raise Hang()

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT_S)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fn(**kwargs)
            if inspect.isgenerator(result):
                next(result, None)
                result.close()
            return result
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def close_all(objects) -> None:
    for obj in objects:
        with_close = getattr(obj, "close", None)
        if callable(with_close) and not isinstance(obj, type):
            try:
                with_close()
            except Exception:
                pass


def judge(c: Ctx, name: str, param: str, kind: str, value) -> tuple[str, str] | None:
    """Runs the callable with ``param=value`` (the rest valid); ``None`` if it ended as it must, else
    ``(class, detail)``."""
    call = FACTORIES[name](c)
    kwargs = {**call.kwargs, param: value}
    states = [v for v in call.kwargs.values() if isinstance(v, jddp.TrainState)]
    before = snapshot(c.root)
    result = None
    try:
        result = run_once(call.fn, kwargs)
    except Hang:
        return ("hang", f"no answer in {TIMEOUT_S} s")
    except Reached:
        result = "reached"
    except BaseException as error:
        text = f"{type(error).__module__}.{type(error).__name__}: {str(error)[:300]}"
        if isinstance(error, CRASHES):
            return ("crash", text)
        if not isinstance(error, ALLOWED) or not raised_in_jddp(error) or not names(str(error), param):
            return ("foreign", text)
        if snapshot(c.root) != before:
            return ("changed", f"refused, but files changed: {text}")
        if any(x.is_deleted() for s in states for x in jax.tree.leaves(s)):
            return ("changed", f"refused, but the state was donated: {text}")
        return None
    finally:
        close_all([*call.cleanup, result])
    if accepted(name, param, kind) is not None:
        return None
    return ("silent", f"returned {type(result).__name__}")


# ----------------------------------------------------------------- the session


@pytest.fixture(scope="module")
def ctx(tmp_path_factory, monkeypatch_module):
    if jax.device_count() != 8:
        pytest.skip("needs the 8 simulated devices of conftest.py")
    root = tmp_path_factory.mktemp("api")
    monkeypatch_module.chdir(root)  # a relative path taken by mistake ("", "~x") lands here, not in the repo
    return Ctx(root)


@pytest.fixture(scope="module")
def monkeypatch_module():
    """``initialize`` must not join a group: reaching the join is taking the value."""
    from jddp.runtime import distributed

    mp = pytest.MonkeyPatch()

    def reached(*args, **kwargs):
        raise Reached()

    mp.setattr(distributed, "_prepare_backend", reached)
    mp.setattr(distributed, "_join", reached)
    yield mp
    mp.undo()


CALLABLES = public_callables()
CALLED = sorted(n for n in CALLABLES if n not in NOT_CALLED)


def test_every_public_callable_has_a_factory():
    missing = [n for n in CALLED if n not in FACTORIES]
    assert not missing, f"public callables without a valid call in FACTORIES (add one): {missing}"
    stale = sorted(set(FACTORIES) - set(CALLABLES)) + sorted(set(NOT_CALLED) - set(CALLABLES))
    assert not stale, f"entries for callables that are no longer public: {stale}"
    assert len(CALLED) >= 80, CALLED  # the walk sees the API


def test_the_walk_sees_methods_submodules_and_their_parameters():
    for name in ("jddp.DataParallel.step", "jddp.Checkpointer.save", "jddp.data.DataLoader", "jddp.models.eqx_split"):
        assert name in CALLABLES, name
    assert [p.name for p in parameters(CALLABLES["jddp.data.DataLoader"])][:2] == ["source", "global_batch_size"]
    assert not any(n.startswith("jddp.cli") for n in CALLABLES)


def shown(value) -> str:
    try:
        return f"{value!r:.60}"
    except Exception:  # a deleted jax.Array cannot show its values
        return f"<{type(value).__name__}>"


def cases_of(c: Ctx, name: str) -> list[tuple[str, str, Any]]:
    params = parameters(CALLABLES[name])
    call = FACTORIES[name](c)
    close_all(call.cleanup)
    out = []
    for p in params:
        kind = kind_of(p.name, str(p.annotation) if p.annotation is not p.empty else "", p.default)
        valid = call.kwargs.get(p.name, None if p.default is p.empty else p.default)
        out += [(p.name, k, v) for k, v in wrong_values(kind, p, valid, c)]
    return out + with_tuple(call, params)


@pytest.mark.parametrize("name", CALLED)
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_the_baseline_call_is_valid(ctx, name):
    call = FACTORIES[name](ctx)
    result = None
    try:
        result = run_once(call.fn, call.kwargs)
    finally:
        close_all([*call.cleanup, result])


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=PENDING[n], strict=True, raises=AssertionError))
        if n in PENDING
        else pytest.param(n, marks=pytest.mark.skip(reason=KILLS_THE_PROCESS[n]))
        if n in KILLS_THE_PROCESS
        else n
        for n in CALLED
    ],
)
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_every_wrong_value_is_refused_naming_its_parameter_or_accepted_on_purpose(ctx, name):
    findings = []
    for param, kind, value in cases_of(ctx, name):
        found = judge(ctx, name, param, kind, value)
        key = (name, param, kind)
        if key in KNOWN:
            assert found is not None, f"{key} is refused well now: drop it from KNOWN"
            continue
        if found is not None:
            findings.append(f"{found[0]}: {param}=<{kind}> {shown(value)}: {found[1]}")
    assert not findings, f"{name}:\n  " + "\n  ".join(findings)


def numeric_params() -> list[tuple[str, str, str]]:
    """``(callable, parameter, kind)`` of every int, float and bool parameter of the callables without pending
    findings whose calls are cheap (no compile, no checkpoint)."""
    out = []
    for name in CALLED:
        if name in PENDING or name.startswith(("jddp.fit", "jddp.DataParallel", "jddp.Checkpointer")):
            continue
        for p in parameters(CALLABLES[name]):
            kind = kind_of(p.name, str(p.annotation) if p.annotation is not p.empty else "", p.default)
            if kind in ("int", "float", "bool"):
                out.append((name, p.name, kind))
    return out


NUMERIC = numeric_params()
not_a_number = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not math.isfinite(x) or x != int(x)),
    st.text(max_size=6),
    st.sampled_from([None, True, False, b"1", [1], (1,), {}, 1j]),
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(case=st.sampled_from(NUMERIC), value=not_a_number)
def test_any_non_number_for_a_number_or_bool_is_refused_naming_it(ctx, case, value):
    """A NaN, an infinity, a fraction, a string or a container for an int, float or bool parameter, drawn by
    hypothesis: refused naming the parameter, unless the parameter takes None or a bool is its kind."""
    name, param, kind = case
    p = next(q for q in parameters(CALLABLES[name]) if q.name == param)
    if (value is None and optional(p)) or (isinstance(value, bool) and kind == "bool"):
        return
    if isinstance(value, float) and kind == "float" and math.isfinite(value) and value > 0:
        return  # a positive fraction is a valid float
    found = judge(ctx, name, param, "hypothesis", value)
    assert found is None, (name, param, value, found)
