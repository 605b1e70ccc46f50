"""The user's own model for ``jddp bench --model MODULE:FUNCTION``.

``FUNCTION`` is called with no arguments in every process of every
configuration and returns a :class:`BenchModel` (or a dict with the same
keys)::

    # mymodel.py, in the folder jddp bench runs from
    import jax.numpy as jnp, numpy as np, optax
    import jddp
    from jddp.benchmark import BenchModel

    def bench():
        def loss_fn(params, model_state, batch, rng):
            logits = batch["x"] @ params["w"]
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, (model_state, {})

        def batch(size):  # size = --batch-per-device x the configuration's devices
            rng = np.random.default_rng(0)
            return {"x": rng.normal(size=(size, 40)).astype(np.float32), "y": rng.integers(0, 10, size, np.int32)}

        return BenchModel(loss_fn, {"w": jnp.zeros((40, 10))}, batch, optimizer=optax.sgd(0.1))

    $ jddp bench --model mymodel:bench --devices 1,2

``MODULE`` is imported from Python's import path with the current directory
first, as ``python -m`` does. The parent process of ``jddp bench`` checks the
model in a child process (``python -m jddp.benchmark.custom MODULE:FUNCTION``)
before any configuration runs, so that it imports no JAX itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# `jddp bench --help`'s epilog: what --model MODULE:FUNCTION takes.
HELP = """\
your own model: --model MODULE:FUNCTION
  MODULE is imported as python -m imports (the current directory first); FUNCTION() takes no
  arguments and returns a jddp.benchmark.BenchModel, or a dict with the same keys:
    loss_fn      loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics)),
                 as for jddp.DataParallel (jddp.models.nnx_loss, linen_loss, eqx_loss build one)
    params       the parameters, a pytree of arrays
    batch        a dict of arrays with a leading batch axis (its first --batch-per-device x dev
                 rows are used, repeated if it has fewer), or batch(global_batch_size) -> such a dict
    optimizer    optional: an optax.GradientTransformation (default optax.adamw(1e-3, weight_decay=1e-4))
    model_state  optional: the model state loss_fn reads and returns (default None)
  The hand and bare programs call loss_fn at the initial model_state with a fixed key (a Weighted
  loss as total / weight). Example (docs/guides/benchmarks.md):
    # mymodel.py
    def bench():
        return {"loss_fn": loss_fn, "params": params, "batch": {"x": x, "y": y}}
    $ jddp bench --model mymodel:bench --devices 1,2
"""
FIELDS = ("loss_fn", "params", "batch", "optimizer", "model_state")
REQUIRED = ("loss_fn", "params", "batch")
CONTRACT = (
    "FUNCTION() must return a jddp.benchmark.BenchModel(loss_fn, params, batch, optimizer=None, model_state=None) "
    "or a dict with those keys (loss_fn, params and batch required): loss_fn as for jddp.DataParallel, "
    "batch a dict of arrays with a leading batch axis or a function batch(global_batch_size) -> such a dict, "
    "optimizer an optax.GradientTransformation (default optax.adamw(1e-3, weight_decay=1e-4))."
)


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """What ``FUNCTION`` of ``jddp bench --model MODULE:FUNCTION`` returns: the model the bench times.

    Attributes:
      loss_fn: ``loss_fn(params, model_state, batch, rng) -> (loss, (model_state, metrics))``, the contract of
        ``jddp.DataParallel`` (``jddp.models.nnx_loss``, ``linen_loss`` and ``eqx_loss`` build one).
      params: the parameters, a pytree of arrays (host or device).
      batch: a dict of arrays whose leading axis is the batch (its first ``global_batch_size`` rows are used,
        repeated where it has fewer), or ``batch(global_batch_size) -> dict`` of arrays with that leading axis.
      optimizer: an ``optax.GradientTransformation``; ``None`` is ``optax.adamw(1e-3, weight_decay=1e-4)``, the
        built-in models' optimizer.
      model_state: the model state ``loss_fn`` reads and returns (``None`` for none).
    """

    loss_fn: Callable[..., Any]
    params: Any
    batch: Mapping[str, Any] | Callable[[int], Mapping[str, Any]]
    optimizer: Any = None
    model_state: Any = None


def is_spec(model: str) -> bool:
    """Whether ``model`` has the form ``MODULE:FUNCTION``."""
    return bool(SPEC.match(model))


def _import_path() -> None:
    """Puts the current directory first on ``sys.path``, as ``python -m`` does."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def find(spec: str) -> None:
    """Raises ``ValueError`` if ``MODULE`` of ``spec`` is not on the import path; imports at most its parents.

    The parent process of ``jddp bench`` calls this before starting anything.
    """
    module = spec.partition(":")[0]
    _import_path()
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a parent package missing
        found = None
    if found is None:
        raise ValueError(
            f"`model`: no module {module!r} on Python's import path (the current directory {os.getcwd()!r} first, "
            f"as for python -m), got model={spec!r}. Run jddp bench from the folder that holds "
            f"{module.replace('.', '/')}.py, or add its folder to PYTHONPATH."
        )


def load(spec: str) -> BenchModel:
    """Imports ``MODULE``, calls ``FUNCTION()`` and checks what it returns.

    Raises:
      ValueError: ``spec`` is not ``MODULE:FUNCTION``, or the module is not found.
      TypeError: ``FUNCTION`` is missing or not callable, or returns something else than the contract.
      RuntimeError: importing the module or calling ``FUNCTION`` raised (chained).
    """
    if not is_spec(spec):
        raise ValueError(f"`model` must be MODULE:FUNCTION (such as mymodel:bench), got model={spec!r}.")
    module_name, _, function_name = spec.partition(":")
    find(spec)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RuntimeError(f"`model`: importing {module_name!r} (model={spec!r}) raised {e!r}.") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        got = "has no attribute of that name" if function is None else f"is a {type(function).__name__}"
        raise TypeError(
            f"`model`: {function_name!r} in module {module_name!r} ({getattr(module, '__file__', '?')}) {got}, "
            f"got model={spec!r}; the module's callables are {public}. Name a function that takes no arguments."
        )
    try:
        returned = function()
    except Exception as e:
        raise RuntimeError(f"`model`: calling {spec}() raised {e!r}.") from e
    return check(spec, returned)


def check(spec: str, returned: Any) -> BenchModel:
    """``returned`` as a :class:`BenchModel`, or ``TypeError`` naming what is wrong with it."""
    if isinstance(returned, Mapping):
        unknown, missing = set(returned) - set(FIELDS), [k for k in REQUIRED if k not in returned]
        if unknown or missing:
            raise TypeError(
                f"`model`: {spec}() returned a dict with keys {sorted(returned)}"
                + (f", unknown {sorted(unknown)}" if unknown else "")
                + (f", missing {missing}" if missing else "")
                + f". {CONTRACT}"
            )
        returned = BenchModel(**returned)
    if not isinstance(returned, BenchModel):
        raise TypeError(f"`model`: {spec}() returned a {type(returned).__name__}. {CONTRACT}")
    if not callable(returned.loss_fn):
        raise TypeError(f"`model`: {spec}()'s loss_fn is a {type(returned.loss_fn).__name__}, not callable.")
    if not (callable(returned.batch) or isinstance(returned.batch, Mapping)):
        raise TypeError(f"`model`: {spec}()'s batch is a {type(returned.batch).__name__}. {CONTRACT}")
    if returned.optimizer is not None and not all(
        callable(getattr(returned.optimizer, k, None)) for k in ("init", "update")
    ):
        raise TypeError(
            f"`model`: {spec}()'s optimizer is a {type(returned.optimizer).__name__}, not an optax "
            "GradientTransformation (init and update); pass None for optax.adamw(1e-3, weight_decay=1e-4)."
        )
    return returned


def global_batch(model: BenchModel, spec: str, size: int) -> dict:
    """The model's batch of ``size`` rows as a dict of NumPy arrays (its rows repeated where it has fewer)."""
    import numpy as np

    made = model.batch(size) if callable(model.batch) else model.batch
    if not isinstance(made, Mapping) or not made:
        raise TypeError(f"`model`: {spec}()'s batch gave a {type(made).__name__}, not a non-empty dict of arrays.")
    out = {}
    for key, value in made.items():
        a = np.asarray(value)
        if a.ndim == 0 or a.shape[0] == 0:
            raise ValueError(f"`model`: {spec}()'s batch[{key!r}] has shape {a.shape}; it needs a leading batch axis.")
        if callable(model.batch) and a.shape[0] != size:
            raise ValueError(
                f"`model`: {spec}()'s batch({size}) gave batch[{key!r}] of {a.shape[0]} rows; it must give {size}."
            )
        out[key] = np.resize(a, (size, *a.shape[1:])) if a.shape[0] != size else a
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m jddp.benchmark.custom MODULE:FUNCTION``: exits 0 if the model loads, else 2 with the reason."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        model = load(argv[0])
        global_batch(model, argv[0], 2)
    except (ValueError, TypeError, RuntimeError) as e:  # one line, read by jddp.cli.bench.check_model
        print(f"{type(e).__name__}: " + str(e).replace("\n", " "), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # run the imported module's main, whose BenchModel is the one users import
    sys.exit(importlib.import_module("jddp.benchmark.custom").main())
