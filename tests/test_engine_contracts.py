"""The contracts of the user's callables (``jddp.engine.contracts.CONTRACTS``), enforced: violations generated from
the table, each refused at trace time naming the callable, the leaf and the expectation, with the state untouched.

The violations are not a hand-written list: ``violations(contract)`` derives them from the row's ``kind`` and
``dtypes`` (a loss of another shape or an integer dtype, a metric under each of jddp's reserved names, a model state
or gradient tree with a leaf dropped, added, reshaped or recast, ...), and ``inject`` puts each into the
callable the row names. A row added to the table without an injection fails ``test_every_contract_is_exercised``.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.engine import contracts

N = 8
PARAMS = {"w": np.full((3, 2), 0.5, np.float32), "b": np.zeros((2,), np.float32)}
MODEL_STATE = {"calls": np.zeros((), np.int32), "mean": np.zeros((2,), np.float32)}
BATCH = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3) / 48, "y": np.ones((16, 2), np.float32)}


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices")
    return jddp.data_mesh()


def _forward(params, batch):
    return batch["x"] @ params["w"] + params["b"][None, :]


def _loss_parts(params, model_state, batch):
    out = _forward(params, batch)
    loss = jnp.mean((out - batch["y"]) ** 2)
    new_state = {"calls": model_state["calls"] + 1, "mean": jnp.mean(out, axis=0)}
    return loss, new_state, {"err": jnp.mean(jnp.abs(out - batch["y"]))}


# ------------------------------------------------------------------------------------------ violations

LIKE = {"model_state": MODEL_STATE, "grads": PARAMS}  # the input each tree_like contract's result must match
METRIC = {"loss_fn": "err", "eval_fn": "err", "grad_hook": "grads_norm"}  # each callable's valid metric


def _tree_violations(like: dict) -> Iterator[tuple[str, Callable, str]]:
    """For a ``tree_like`` contract over the input ``like``: each leaf dropped, one added, the dict made a list,
    each leaf reshaped (and, if not a scalar, summed to one), each leaf recast."""
    for key in like:
        yield f"[{key!r}] dropped", lambda t, key=key: {k: v for k, v in t.items() if k != key}, "tree"
    yield "a leaf added", lambda t: {**t, "extra": jnp.zeros(())}, "tree"
    yield "a list for the dict", lambda t: list(t.values()), "tree"
    for key, leaf in like.items():
        yield (
            f"[{key!r}] reshaped",
            lambda t, key=key: {**t, key: jnp.reshape(t[key], (1, *jnp.shape(t[key])))},
            rf"\[{key!r}\] of shape=.*must keep shape=",
        )
        if np.ndim(leaf):
            yield (
                f"[{key!r}] summed to a scalar",
                lambda t, key=key: {**t, key: jnp.sum(t[key])},
                rf"\[{key!r}\] of shape=\(\).*must keep shape=",
            )
        yield (
            f"[{key!r}] recast",
            lambda t, key=key: {**t, key: t[key].astype(_other_dtype(t[key].dtype))},
            rf"\[{key!r}\] of dtype=.*must keep dtype=",
        )


def _other_dtype(dtype):
    return jnp.float32 if not jnp.issubdtype(dtype, jnp.floating) else jnp.bfloat16


def _scalar_violations(where: str, dtypes: str) -> Iterator[tuple[str, Callable, str]]:
    """For a scalar value (a loss, one metric): another shape, a non-array, a complex number; for a float
    contract, every integer and bool dtype; each also inside a ``jddp.Weighted``."""
    yield "a vector", lambda v: jnp.stack([v, v]), rf"must be a scalar \(shape=\(\)\), got {where} of shape=\(2,\)"
    yield "a string", lambda v: "high", rf"{where} of type str, but it must be a scalar"
    yield "complex", lambda v: v.astype(jnp.complex64), rf"{where} of dtype=complex64.*real number"
    if dtypes == "float":
        for dtype in (jnp.int32, jnp.int8, jnp.uint32, jnp.bool_):
            name = jnp.dtype(dtype).name
            yield f"as {name}", lambda v, d=dtype: v.astype(d), rf"{where} of dtype={name}.*must be a float"
            yield (
                f"Weighted total as {name}",
                lambda v, d=dtype: jddp.Weighted(v.astype(d), jnp.float32(1)),
                rf"{where}.total of dtype={name}.*must be a float",
            )
    yield (
        "Weighted of a vector weight",
        lambda v: jddp.Weighted(v, jnp.ones(2)),
        rf"{where}.weight of shape=\(2,\)",
    )


def _metrics_violations(contract) -> Iterator[tuple[str, Callable, str]]:
    """For a ``metrics`` contract: not a dict, every reserved name and prefix, a non-str name, and every scalar
    violation on one metric."""
    part = contract.part
    yield "a list", lambda m: list(m.values()), rf"{part} of type list, but it must be a dict"
    for name in (*contract.reserved, *(p + "0" for p in contract.prefixes)):
        yield (
            f"named {name!r}",
            lambda m, name=name: {**m, name: next(iter(m.values()))},
            rf"{part}\[{name!r}\] under a name jddp reports itself.*reserved",
        )
    yield "a name that is not a str", lambda m: {**m, 3: next(iter(m.values()))}, r"names are str"
    key = METRIC[contract.fn]
    for what, make, pattern in _scalar_violations(rf"{part}\[{key!r}\]", contract.dtypes):
        yield f"[{key!r}] {what}", lambda m, make=make: {**m, key: make(m[key])}, pattern


def violations(contract) -> list[tuple[str, Callable, str]]:
    if contract.kind == "tree_like":
        return list(_tree_violations(LIKE[contract.like]))
    if contract.kind == "metrics":
        return list(_metrics_violations(contract))
    return list(_scalar_violations(contract.part, contract.dtypes))


# ------------------------------------------------------------------------------------------ injection


def _engine(mesh, contract, mutate: Callable):
    """A DataParallel (and the call that traces it) whose callable ``contract.fn`` returns ``mutate(valid)`` for
    ``contract.part``."""
    fn, part = contract.fn, contract.part
    options: dict = {}

    def loss_fn(params, model_state, batch, rng):
        loss, new_state, metrics = _loss_parts(params, model_state, batch)
        if fn == "loss_fn" and part == "loss":
            loss = mutate(loss)
        if fn == "loss_fn" and part == "new_model_state":
            new_state = mutate(new_state)
        if fn == "loss_fn" and part == "metrics":
            metrics = mutate(metrics)
        return loss, (new_state, metrics)

    if fn == "eval_fn":
        options["eval_fn"] = lambda params, model_state, batch: mutate(_loss_parts(params, model_state, batch)[2])
    if fn == "grad_hook":

        def hook(grads, params):
            metrics = {METRIC["grad_hook"]: optax.tree.norm(grads)}
            return (mutate(grads), metrics) if part == "grads" else (grads, mutate(metrics))

        options["grad_hook"] = hook
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh, **options)
    return dp, (dp.eval_step if fn == "eval_fn" else dp.step)


INJECTED = {
    ("loss_fn", "loss"),
    ("loss_fn", "new_model_state"),
    ("loss_fn", "metrics"),
    ("eval_fn", "metrics"),
    ("grad_hook", "grads"),
    ("grad_hook", "metrics"),
}


def test_every_contract_is_exercised():
    """Each row of the table has an injection here and at least one generated violation of each of its
    properties (tree, shape, dtype or name)."""
    assert {(c.fn, c.part) for c in contracts.CONTRACTS} == INJECTED
    for contract in contracts.CONTRACTS:
        patterns = " ".join(p for _, _, p in violations(contract))
        assert "shape" in patterns and "dtype" in patterns, contract


CASES = [(c, *v) for c in contracts.CONTRACTS for v in violations(c)]


@pytest.mark.parametrize(
    ("contract", "what", "mutate", "pattern"), CASES, ids=[f"{c.fn}.{c.part}: {w}" for c, w, _, _ in CASES]
)
def test_a_violation_is_refused_naming_the_callable_the_leaf_and_the_expectation(mesh, contract, what, mutate, pattern):
    dp, call = _engine(mesh, contract, mutate)
    state = dp.init(PARAMS, MODEL_STATE, rng=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a reserved-name case may also make every gradient constant
        with pytest.raises((TypeError, ValueError)) as info:
            call(state, BATCH)
    message = str(info.value)
    assert f"`{contract.fn}`" in message, message
    if pattern != "tree":
        assert re.search(pattern, message, re.S), f"{pattern!r} not in {message!r}"
    else:
        assert "must have the tree of" in message and f"`{contract.like}`" in message, message
    assert contract.fix.split("(")[0].strip() in message, message
    # Refused while tracing: no program ran, the state was neither donated nor changed.
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert int(state.step) == 0 and np.array_equal(jddp.models.to_host(state.params)["w"], PARAMS["w"])


def test_the_valid_callables_pass_every_contract(mesh):
    """The harness itself is valid: with the identity for every part, every engine trains (and evaluates)."""
    for contract in contracts.CONTRACTS:
        dp, call = _engine(mesh, contract, lambda x: x)
        state = dp.init(PARAMS, MODEL_STATE, rng=0)
        out = call(state, BATCH)
        metrics = out if contract.fn == "eval_fn" else out[1]
        assert np.isfinite(metrics["loss" if contract.fn != "eval_fn" else "err"])


# ------------------------------------------------------------------------------------------ seen from outside


@pytest.mark.parametrize("nonfinite", ["skip", "raise"])
def test_a_grad_hook_that_returns_nan_is_caught_by_the_guard(mesh, nonfinite):
    """The guard reads what is applied (the hook's gradients), not only what the loss produced: a hook that
    returns NaN skips the step on every replica (``nonfinite`` 1, params unchanged) or raises."""

    def loss_fn(params, model_state, batch, rng):
        loss, new_state, metrics = _loss_parts(params, model_state, batch)
        return loss, (new_state, metrics)

    hook = lambda grads, params: {**grads, "b": grads["b"] * jnp.nan}
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh, grad_hook=hook, nonfinite=nonfinite)
    state = dp.init(PARAMS, MODEL_STATE, rng=0)
    if nonfinite == "raise":
        with pytest.raises(jddp.NonFiniteError, match=r"Non-finite loss or gradient at step=0") as info:
            dp.step(state, BATCH)
        new = info.value.state
    else:
        new, metrics = dp.step(state, BATCH)
        assert metrics["nonfinite"] == 1.0 and np.isfinite(metrics["grad_norm"])
    host = jddp.models.to_host(new.params)
    assert all(np.array_equal(host[k], PARAMS[k]) for k in PARAMS)
    assert int(new.model_state["calls"]) == 0  # the model state of a skipped step is not taken either


def test_a_loss_that_does_not_depend_on_params_warns(mesh):
    held = jax.tree.map(jnp.asarray, PARAMS)  # the parameters in a closure, not the argument

    def loss_fn(params, model_state, batch, rng):
        loss, new_state, metrics = _loss_parts(held, model_state, batch)
        return loss, (new_state, metrics)

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
    with pytest.warns(UserWarning, match=r"`loss_fn`'s loss does not depend on `params`.*every gradient is zero"):
        dp.step(dp.init(PARAMS, MODEL_STATE, rng=0), BATCH)


def test_a_loss_of_some_parameters_does_not_warn(mesh):
    """A parameter the loss does not use (an unused head) is not a loss without parameters."""

    def loss_fn(params, model_state, batch, rng):
        loss, new_state, metrics = _loss_parts({**params, "b": jnp.zeros(2)}, model_state, batch)
        return loss, (new_state, metrics)

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp.step(dp.init(PARAMS, MODEL_STATE, rng=0), BATCH)


def test_a_metric_named_like_jddps_is_refused_in_eval_without_eval_fn(mesh):
    """eval_step without an eval_fn reports loss_fn's loss and metrics: a metric named "loss" would have
    overwritten the loss there (the step refused it, eval did not)."""

    def loss_fn(params, model_state, batch, rng):
        loss, new_state, metrics = _loss_parts(params, model_state, batch)
        return loss, (new_state, {**metrics, "loss": 2 * loss})

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match=r"`loss_fn` returned metrics\['loss'\] under a name jddp reports itself"):
        dp.eval_step(dp.init(PARAMS, MODEL_STATE, rng=0), BATCH)
