"""RunningMeans: the example-weighted means of step metrics over many steps, against NumPy; skipped steps left out;
its state through a real checkpoint (``Checkpointer(..., extra=...)``) continues the same sums."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.engine.metrics import Metrics, RunningMeans

NAMES = ("loss", "examples", "grad_norm", "nonfinite", "accuracy")


def rows(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.stack(
        [
            rng.uniform(0.1, 3.0, n),
            rng.integers(0, 17, n).astype(np.float64),  # uneven, some steps without a real example
            rng.uniform(0, 2, n),
            (rng.uniform(size=n) < 0.2).astype(np.float64),  # skipped steps
            rng.uniform(0, 1, n),
        ],
        axis=1,
    )
    out[out[:, 3] == 1, 0] = np.nan  # a skipped step's loss is not finite
    return out.astype(np.float32).astype(np.float64)  # what the devices hold


def reference(table: np.ndarray) -> dict:
    kept = table[table[:, 3] == 0]
    w = kept[:, 1]
    out = {name: float(np.sum(kept[:, i] * w) / np.sum(w)) for i, name in enumerate(NAMES) if i not in (1, 3)}
    return {**out, "examples": float(w.sum()), "steps": len(table), "nonfinite": int(table[:, 3].sum())}


def test_means_are_weighted_by_examples_and_leave_skipped_steps_out():
    table = rows(0, 40)
    assert table[:, 3].sum() > 0 and (table[:, 1] == 0).any()
    means = RunningMeans()
    for row in table:
        means.add(Metrics(NAMES, jnp.asarray(row, jnp.float32)))
    got = means.compute()
    expected = reference(table)
    assert got == pytest.approx(expected, rel=1e-12)
    assert means.last == pytest.approx(dict(zip(NAMES, table[-1].tolist(), strict=True)), nan_ok=True)


def test_a_window_feeds_its_parent_and_reset_starts_afresh():
    table = rows(1, 30)
    epoch = RunningMeans()
    window = RunningMeans(parent=epoch)
    for i, row in enumerate(table):
        window.add(Metrics(NAMES, jnp.asarray(row)))
        if i % 7 == 6:
            assert window.compute() == pytest.approx(reference(table[i - 6 : i + 1]), rel=1e-12)
            window.reset()
    window.compute()
    assert epoch.compute() == pytest.approx(reference(table), rel=1e-12)


def test_metrics_without_examples_are_refused():
    with pytest.raises(ValueError, match=r"needs the step's `examples`, got metrics \['loss'\]"):
        RunningMeans().add(Metrics(("loss",), jnp.zeros(1)))


def test_the_state_goes_through_a_checkpoint_and_continues_the_same_sums(tmp_path):
    table = rows(2, 20)
    uninterrupted = RunningMeans()
    first = RunningMeans()
    for row in table[:12]:
        first.add(Metrics(NAMES, jnp.asarray(row)))
    dp = jddp.DataParallel(lambda p, s, b, r: (jnp.sum(p["w"]), (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh())
    state = dp.init({"w": np.zeros(3, np.float32)})
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(state, extra=first, wait=True)
    resumed = RunningMeans()
    with jddp.Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        ckpt.restore_or_init(dp.init({"w": np.ones(3, np.float32)}), extra=resumed)
    for row in table[12:]:
        resumed.add(Metrics(NAMES, jnp.asarray(row)))
    for row in table:
        uninterrupted.add(Metrics(NAMES, jnp.asarray(row)))
    assert resumed.compute() == uninterrupted.compute()  # bitwise: the same sums in the same order
    assert resumed.compute() == pytest.approx(reference(table), rel=1e-12)


def test_extra_without_get_state_is_refused_before_anything_is_written(tmp_path):
    dp = jddp.DataParallel(lambda p, s, b, r: (jnp.sum(p["w"]), (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh())
    state = dp.init({"w": np.zeros(3, np.float32)})
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
        with pytest.raises(TypeError, match=r"`extra` must have get_state\(\) and set_state\(state\).*got dict"):
            ckpt.save(state, extra={"a": 1})
        assert ckpt.all_steps() == []
        with pytest.raises(TypeError, match=r"`extra` must have get_state\(\) and set_state\(state\).*got int"):
            ckpt.restore_or_init(state, extra=3)
    jax.block_until_ready(state)


def test_steps_without_real_examples_weigh_nothing_and_an_empty_window_is_zero():
    means = RunningMeans()
    assert means.compute() == {"examples": 0.0, "steps": 0}  # nothing added yet
    means.add(Metrics(("loss", "examples"), jnp.array([7.0, 0.0])))  # a global batch of padding
    assert means.compute() == {"loss": 0.0, "examples": 0.0, "steps": 1}
    means.add(Metrics(("loss", "examples"), jnp.array([3.0, 1.0])))  # one real example
    assert means.compute() == {"loss": 3.0, "examples": 1.0, "steps": 2}


def test_nonfinite_is_reported_only_by_steps_that_report_it():
    """A step of `nonfinite="ignore"` has no `nonfinite`: no step is left out and none is counted."""
    ignored = RunningMeans()
    ignored.add(Metrics(("loss", "examples"), jnp.array([2.0, 4.0])))
    assert ignored.compute() == {"loss": 2.0, "examples": 4.0, "steps": 1}
    guarded = RunningMeans()
    guarded.add(Metrics(("loss", "examples", "nonfinite"), jnp.array([2.0, 4.0, 0.0])))
    assert guarded.compute() == {"loss": 2.0, "examples": 4.0, "steps": 1, "nonfinite": 0}


def test_the_state_keeps_the_last_step():
    first = RunningMeans()
    first.add(Metrics(("loss", "examples", "nonfinite"), jnp.array([2.0, 4.0, 0.0])))
    again = RunningMeans()
    again.set_state(first.get_state())
    assert again.last == first.last == {"loss": 2.0, "examples": 4.0, "nonfinite": 0.0}
    assert again.compute() == first.compute()


def test_a_weighted_loss_and_metric_are_averaged_over_their_own_weights_across_steps():
    """A per-token loss (``jddp.Weighted``) and a per-token metric: the means over several steps weigh each
    step by its tokens, as one big batch would, not by its examples (one step of long sequences, one of short
    ones). Checked against NumPy over all tokens; before, the loss's mean over the two steps was weighted 4:4."""
    n, t = 8, 6
    rs = np.random.RandomState(0)
    x = rs.randn(n, t).astype(np.float32)
    lengths = np.array([6, 6, 6, 6, 1, 1, 1, 1])
    tokens = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)

    def loss_fn(p, ms, b, rng):
        mask = b["tokens"]
        per_token = (b["x"] * p["w"]) ** 2 * mask
        weight = mask.sum()
        return jddp.Weighted(per_token.sum(), weight), (ms, {"big": jddp.Weighted((per_token > 1).sum(), weight)})

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.0), mesh=jddp.data_mesh(jax.devices()[:2]))
    state = dp.init({"w": np.ones((), np.float32)})
    means = RunningMeans()
    for rows_ in (slice(0, 4), slice(4, 8)):
        state, metrics = dp.step(state, {"x": x[rows_], "tokens": tokens[rows_]})
        means.add(metrics)
    out = means.compute()
    assert out["loss"] == pytest.approx(float(((x**2) * tokens).sum() / tokens.sum()), rel=1e-6)
    assert out["big"] == pytest.approx(float(((x**2 > 1) * tokens).sum() / tokens.sum()), rel=1e-6)
    assert out["examples"] == 8 and out["steps"] == 2


def test_a_state_that_is_not_get_states_is_refused_and_changes_nothing():
    means = RunningMeans()
    means.add(Metrics(("loss", "examples"), jnp.array([2.0, 4.0])))
    before = means.compute()
    for bad in (None, [1, 2], "state", {"sums": {"loss": 1.0}}, {**means.get_state(), "steps": 1.5}):
        with pytest.raises(TypeError, match=r"`state` must be the dict that `RunningMeans.get_state` returned"):
            means.set_state(bad)  # pyright: ignore[reportArgumentType]
        assert means.compute() == before
    with pytest.raises(TypeError, match=r"`metrics` must be the jddp.Metrics that `DataParallel.step` returned"):
        means.add({"loss": 1.0, "examples": 2.0})  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`parent` must be a RunningMeans or None, got dict"):
        RunningMeans(parent={})  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("seed", range(4))
def test_a_state_read_later_is_the_state_at_the_call_whatever_follows(seed):
    """``get_state_later`` (what in-memory snapshots read in their writer) at drawn points of a run, some steps read
    before it and some pending: called after more steps were added, computed, and the means reset, it returns what
    ``get_state`` returned at the call, for the window and the epoch that counts it (``jddp.fit``'s pair)."""
    from jddp.fit_loop import Means as _Means

    table = rows(seed, 30)
    draws = np.random.default_rng(seed)
    cut, read_at = sorted(draws.choice(np.arange(1, 30), 2, replace=False))
    live, twin = _Means(), _Means()
    for i, row in enumerate(table):
        metrics = Metrics(NAMES, jnp.asarray(row, jnp.float32))
        for means in (live, twin) if i < cut else (live,):
            means.window.add(metrics)
        if i == read_at and i < cut:
            live.window.compute()  # some steps read already
        if i == cut - 1:
            later, window_later = live.get_state_later(), live.window.get_state_later()
    live.window.compute()
    live.window.reset()
    assert json.dumps(later()) == json.dumps(twin.get_state())  # as written to a snapshot (NaN, a skipped loss)
    assert json.dumps(window_later()) == json.dumps(twin.window.get_state())
