"""Randomness that does not depend on the device layout (``DataParallel(rng="example")``, the default).

With dropout on, the same seed and the same global batches give the same losses on 1, 2 and 8 devices, and on
2 processes x 4 devices, to float round-off; a checkpoint taken on 8 devices resumes on 2 processes x 2 devices
as the uninterrupted run. ``rng="device"`` (a key per device) is the classic recipe and depends on the layout.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import jddp
from tests import dropout_models, multiprocess

STEPS = 20
STEPS_PER_LAYOUT = 8


def losses_on(n: int, make, rng: str = "example", steps: int = STEPS) -> list[float]:
    loss_fn, params, state = make()
    dp = dropout_models.make_dp(loss_fn, jddp.data_mesh(jax.devices()[:n]), rng)
    return dropout_models.train(dp, dp.init(params, model_state=state, rng=0), dropout_models.host_batches(steps))[1]


@pytest.mark.parametrize("library", list(dropout_models.FACTORIES))
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_dropout_trains_alike_on_1_2_and_8_devices(library):
    """1 and 8 devices for every library; 2 (another slice of the same draws) for the first only: each layout is
    a compilation, the slowest part of this test."""
    make = dropout_models.FACTORIES[library]
    layouts = (1, 2, 8) if library == next(iter(dropout_models.FACTORIES)) else (1, 8)
    one, *others = (np.array(losses_on(n, make, steps=STEPS_PER_LAYOUT)) for n in layouts)
    assert all(np.max(np.abs(one - other)) < 1e-5 for other in others), [one - other for other in others]
    assert one[-1] < one[0]  # it trains
    if len(layouts) == 2:
        return
    # The classic key per device gives other masks on every layout: the comparison above can fail.
    per_device = np.array(losses_on(8, make, rng="device", steps=3))
    assert np.max(np.abs(per_device - one[:3])) > 1e-3


def test_rng_must_be_example_or_device():
    loss_fn, _, _ = dropout_models.nnx_model()
    with pytest.raises(ValueError, match=r"`rng` must be 'example' .* or 'device' .*got rng='process'"):
        dropout_models.make_dp(loss_fn, jddp.data_mesh(), rng="process")


@pytest.mark.multiprocess
def test_two_processes_of_four_devices_and_a_resume_on_two_by_two_train_as_one_device(tmp_path):
    one = np.array(losses_on(1, dropout_models.nnx_model))
    multiprocess.run(str(multiprocess.WORKERS / "dropout.py"), 2, 4, str(tmp_path), "train", timeout=600)
    report = json.loads((tmp_path / "dropout-train.json").read_text())
    assert (report["devices"], report["processes"]) == (8, 2)
    assert np.max(np.abs(np.array(report["losses"]) - one)) < 1e-5
    # A checkpoint taken after 10 steps on 8 devices of this process, resumed on 2 processes x 2 devices.
    loss_fn, params, state = dropout_models.nnx_model()
    dp = dropout_models.make_dp(loss_fn, jddp.data_mesh())
    train, first = dropout_models.train(dp, dp.init(params, model_state=state, rng=0), dropout_models.host_batches(10))
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(train, wait=True)
    multiprocess.run(str(multiprocess.WORKERS / "dropout.py"), 2, 2, str(tmp_path), "resume", timeout=600)
    resumed = json.loads((tmp_path / "dropout-resume.json").read_text())
    assert (resumed["devices"], resumed["processes"]) == (4, 2)
    assert np.max(np.abs(np.array(first + resumed["losses"]) - one)) < 1e-5


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_a_draw_inside_a_scan_under_accumulation_folds_the_micro_batch_index_into_the_key():
    """A per-example draw inside a ``lax.scan`` cannot read the micro-batch's place (a value of the engine's own
    scan): such a micro-batch draws with its index folded into the key, for its rows over the devices, as before
    (exact across layouts of the same device count and accumulate_steps). Checked against that computation by
    hand on 2 devices x 2 micro-batches of 4 rows."""
    import jax.numpy as jnp
    import optax

    def per_row(w, x, rng):
        def body(h, t):
            keep = jax.random.bernoulli(jax.random.fold_in(rng, t), 0.7, h.shape)
            return jnp.where(keep, jnp.tanh(h @ w), 0.0), None

        return jnp.sum(jax.lax.scan(body, x, jnp.arange(2))[0], 1)

    def loss_fn(params, model_state, batch, rng):
        return jddp.masked_mean(per_row(params["w"], batch["x"], rng), batch["mask"]), (model_state, {})

    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    w = np.random.default_rng(1).normal(size=(4, 4)).astype(np.float32)
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(jax.devices()[:2]), accumulate_steps=2)
    state = dp.init({"w": w}, rng=0)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0)  # the step's key, as the engine makes it
    _, metrics = dp.step(state, {"x": x, "mask": np.ones(16, np.float32)})
    rows = [np.r_[0:8:2, 8:16:2], np.r_[1:8:2, 9:16:2]]  # micro-batch i of devices 0 and 1, in device order
    expected = sum(float(per_row(w, x[r], jax.random.fold_in(key, i)).sum()) for i, r in enumerate(rows)) / 16
    np.testing.assert_allclose(float(metrics["loss"]), expected, rtol=1e-5)
