"""The contracts of the user's callables, as one table, checked on abstract values while the engine traces them.

jddp calls three functions of the user's inside its compiled programs: ``loss_fn`` (in ``step`` and, without
an ``eval_fn``, in ``eval_step``), ``eval_fn`` and ``grad_hook``. ``CONTRACTS`` says, for each part of what each
returns, the tree it must have, the shapes and dtypes of its leaves, and whether the non-finite guard reads it.
``check`` enforces one row on the values the function returned while JAX traces it: only shapes, dtypes and
tree structures are read, so the checks cost nothing when the compiled step runs, and a violation is refused
before any program runs or any state changes, naming the function, the leaf and what was expected.

What the table prevents (each was silent before): a ``grad_hook`` gradient of another shape broadcast into the
update or of another dtype cast into it; an integer loss trained with a zero gradient; a new model state whose
leaves changed shape or dtype refused by JAX's ``cond`` or ``scan`` with a message about their internals; a user
metric named like one of jddp's own (``RESERVED_METRICS``) overwritten. A loss that does not depend on the
parameters is warned about (``warn_if_constant``): its gradient is zero everywhere.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jddp.engine import reduce

# The names of the metrics jddp itself reports; a user metric of one of these names is refused in every program,
# whichever options make jddp report it, so that turning an option on never changes what a user metric means.
RESERVED_METRICS = ("loss", "examples", "grad_norm", "nonfinite", "loss_scale")
# jddp's per-device metrics with ``local_metrics=True``: ``local_loss/<i>``, ``local_grad_norm/<i>``.
RESERVED_PREFIXES = ("local_loss/", "local_grad_norm/")

Kind = Literal["loss", "tree_like", "metrics"]
Dtypes = Literal["float", "real", "same"]


@dataclasses.dataclass(frozen=True)
class Contract:
    """One part of what a user callable returns, and what it must be.

    Attributes:
      fn: the callable, as the user passes it to ``DataParallel`` (``"loss_fn"``).
      part: the part of its result (``"loss"``, ``"new_model_state"``, ``"metrics"``, ``"grads"``).
      kind: ``"loss"``: a scalar or a ``jddp.Weighted`` of scalars; ``"tree_like"``: the tree of the input
        ``like``, each leaf of its leaf's shape; ``"metrics"``: a dict of scalars (or ``Weighted`` of scalars)
        whose names are not jddp's own.
      dtypes: ``"float"``: a float (the loss, its total); ``"real"``: a number or a bool (metrics: an accuracy
        from a comparison); ``"same"``: the dtype of the matching leaf of ``like``.
      like: for ``"tree_like"``, the input the result must match (``"model_state"``, ``"grads"``).
      guarded: the non-finite guard reads this part (a non-finite value skips the step, ``nonfinite``).
      fix: how to satisfy the contract, ending every error about it.
      reserved: for ``"metrics"``, the names jddp reports itself beside them (refused), and ``prefixes``, the
        name prefixes it does.
    """

    fn: str
    part: str
    kind: Kind
    dtypes: Dtypes
    like: str | None = None
    guarded: bool = False
    fix: str = ""
    reserved: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()


LOSS = Contract(
    "loss_fn",
    "loss",
    "loss",
    "float",
    guarded=True,
    fix="return the mean over the slice's real examples (`jddp.masked_mean(per_example, batch.get('mask'))`) or "
    "`jddp.Weighted(total, weight)`, computed in floating point from `params`",
)
MODEL_STATE = Contract(
    "loss_fn",
    "new_model_state",
    "tree_like",
    "same",
    like="model_state",
    fix="return the model state with the tree, shapes and dtypes it came in with (`model_state` itself if the "
    "model has none); cast a leaf back with `.astype(old.dtype)`",
)
LOSS_METRICS = Contract(
    "loss_fn",
    "metrics",
    "metrics",
    "real",
    fix="return a dict of scalars (means over the slice's real examples, or `jddp.Weighted`), reduced over the "
    "batch inside the function, under names of your own",
    reserved=RESERVED_METRICS,
    prefixes=RESERVED_PREFIXES,
)
# eval_step reports eval_fn's metrics and the examples counted, nothing else of jddp's.
EVAL_METRICS = dataclasses.replace(LOSS_METRICS, fn="eval_fn", reserved=("examples",), prefixes=())
HOOK_GRADS = Contract(
    "grad_hook",
    "grads",
    "tree_like",
    "same",
    like="grads",
    guarded=True,
    fix="`grad_hook` must return the gradients as it got them (a tree of the params' structure, each leaf of its "
    "parameter's shape and dtype), or (grads, metrics)",
)
HOOK_METRICS = dataclasses.replace(LOSS_METRICS, fn="grad_hook")

CONTRACTS: tuple[Contract, ...] = (LOSS, MODEL_STATE, LOSS_METRICS, EVAL_METRICS, HOOK_GRADS, HOOK_METRICS)


def _path(contract: Contract, path) -> str:
    return f"{contract.part}{jax.tree_util.keystr(tuple(path))}"


def _fail(error: type[Exception], contract: Contract, where: str, problem: str) -> Exception:
    return error(f"`{contract.fn}` returned {where} {problem}; {contract.fix}.")


def _kind(dtype) -> str:
    if jnp.issubdtype(dtype, jnp.inexact):
        return "float"
    return "bool" if dtype == np.bool_ else "integer"


def _check_dtype(contract: Contract, where: str, dtype, expected=None) -> None:
    dtype = np.dtype(dtype) if not hasattr(dtype, "name") else dtype
    if contract.dtypes == "same":
        if dtype != expected:
            raise _fail(TypeError, contract, where, f"of dtype={dtype}, but it must keep dtype={expected}")
        return
    if jnp.issubdtype(dtype, jnp.complexfloating) or not (
        jnp.issubdtype(dtype, jnp.number) or dtype == np.bool_ or jnp.issubdtype(dtype, jnp.floating)
    ):
        raise _fail(TypeError, contract, where, f"of dtype={dtype}, but it must be a real number")
    if contract.dtypes == "float" and _kind(dtype) != "float":
        raise _fail(
            TypeError,
            contract,
            where,
            f"of dtype={dtype} ({_kind(dtype)}), but it must be a float: an {_kind(dtype)} value has no gradient, "
            "so the step would train with a zero gradient",
        )


def _check_scalar(contract: Contract, where: str, value) -> None:
    if isinstance(value, reduce.Weighted):
        total_rule = contract if contract.kind == "loss" else dataclasses.replace(contract, dtypes="real")
        _check_scalar(total_rule, f"{where}.total", value.total)
        _check_scalar(dataclasses.replace(contract, dtypes="real"), f"{where}.weight", value.weight)
        return
    if not hasattr(value, "dtype") and not isinstance(value, int | float | bool | np.generic):
        raise _fail(
            TypeError, contract, where, f"of type {type(value).__name__}, but it must be a scalar array or number"
        )
    shape = jnp.shape(value)
    if shape != ():
        what = "loss" if contract.kind == "loss" else f"metric {where}"
        raise ValueError(
            f"The {what} returned by `{contract.fn}` must be a scalar (shape=()), got {where} of shape={shape}; "
            f"{contract.fix}."
        )
    _check_dtype(contract, where, jnp.result_type(value))


def check(contract: Contract, value, like=None) -> None:
    """Raises ``TypeError`` (tree, dtype) or ``ValueError`` (shape, name) unless ``value`` meets ``contract``.

    Args:
      contract: a row of ``CONTRACTS``.
      value: what the user's function returned for ``contract.part`` (tracers: only avals are read).
      like: for a ``"tree_like"`` contract, the input ``value`` must match.
    """
    if contract.kind == "loss":
        _check_scalar(contract, contract.part, value)
    elif contract.kind == "metrics":
        check_metrics(contract, value)
    else:
        _check_tree_like(contract, value, like)


def check_metrics(contract: Contract, metrics) -> None:
    """A dict of scalar metrics under names that are not jddp's (``contract.reserved``, ``contract.prefixes``)."""
    if not isinstance(metrics, dict):
        raise _fail(TypeError, contract, contract.part, f"of type {type(metrics).__name__}, but it must be a dict")
    for name, value in metrics.items():
        where = f"{contract.part}[{name!r}]"
        if not isinstance(name, str):
            raise _fail(TypeError, contract, where, f"under a name of type {type(name).__name__}: names are str")
        if name in contract.reserved or name.startswith(contract.prefixes):
            prefixes = f" and the prefixes {list(contract.prefixes)}" if contract.prefixes else ""
            raise _fail(
                ValueError,
                contract,
                where,
                f"under a name jddp reports itself (Metric names {[name]} are reserved by jddp: "
                f"{sorted(contract.reserved)}{prefixes}); rename it, as it would overwrite jddp's value or be "
                "overwritten by it",
            )
        _check_scalar(contract, where, value)


def _check_tree_like(contract: Contract, value, like) -> None:
    got, want = jax.tree.structure(value), jax.tree.structure(like)
    if got != want:
        raise _fail(
            TypeError,
            contract,
            contract.part,
            f"as a tree {got}, but it must have the tree of `{contract.like}` {want} "
            f"({_tree_difference(contract, value, like)})",
        )
    pairs = zip(jax.tree_util.tree_leaves_with_path(value), jax.tree.leaves(like), strict=True)
    for (path, x), old in pairs:
        where = _path(contract, path)
        if not hasattr(x, "dtype"):
            raise _fail(TypeError, contract, where, f"of type {type(x).__name__}, but it must be an array")
        if jnp.shape(x) != jnp.shape(old):
            raise _fail(
                ValueError,
                contract,
                where,
                f"of shape={jnp.shape(x)}, but it must keep shape={jnp.shape(old)}: another shape would be broadcast "
                "into the update or the next step",
            )
        _check_dtype(contract, where, x.dtype, old.dtype)


def _tree_difference(contract: Contract, value, like) -> str:
    """The first leaf path one tree has and the other has not, in words."""
    got = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(value)}
    want = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(like)}
    missing, extra = sorted(want - got), sorted(got - want)
    if missing:
        return f"{contract.part}{missing[0]} is missing"
    if extra:
        return f"{contract.part}{extra[0]} is not in `{contract.like}`"
    return "the same leaf paths in other containers"


def finite(tree) -> jax.Array:
    """Whether every leaf of ``tree`` (a guarded part) is finite: one boolean scalar, for the non-finite guard."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def warn_if_constant(fn: str, grads_constant: list[bool]) -> None:
    """A ``UserWarning`` when every gradient is a constant of the traced program (zero): ``fn``'s loss does not
    depend on the parameters, or only through ``stop_gradient``, and the step would not train."""
    if grads_constant and all(grads_constant):
        warnings.warn(
            f"`{fn}`'s loss does not depend on `params` (or only through `jax.lax.stop_gradient`): every gradient "
            "is zero, and the step will only decay or keep the parameters. Compute the loss from the `params` "
            "argument that jddp passes, not from parameters held in a closure.",
            UserWarning,
            stacklevel=2,
        )
