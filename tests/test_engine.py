"""DataParallel against independent references: one device, jax.pmap, NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.runtime import dispatch
from tests import models

N = 8
LR = 0.1


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices")
    return jddp.data_mesh()


max_diff = models.max_diff


def train(dp, model, batches):
    state = dp.init(model.params, model.model_state, rng=0)
    for b in batches:
        state, metrics = dp.step(state, b)
    dispatch.DISPATCHER.drain()
    return state, metrics


@pytest.mark.parametrize("kind", list(models.FACTORIES), ids=list(models.FACTORIES))
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_equivalence_to_one_device_and_pmap(mesh, kind):
    model = models.FACTORIES[kind]()
    batches = [models.batch(64, seed) for seed in range(5)]
    state, _ = train(jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh), model, batches)
    ref_params, ref_state = models.reference_sgd(model, batches, LR)
    pmap_params, pmap_state = models.pmap_sgd(model, batches, LR, N)
    assert max_diff(model.params, ref_params) > 1e-2  # training moved the parameters
    if model.model_state:
        assert max_diff(model.model_state, ref_state) > 1e-3  # and the BatchNorm statistics
    assert max_diff(state.params, ref_params) < 1e-6
    assert max_diff(state.params, pmap_params) < 1e-6
    # BatchNorm statistics (linen, nnx): synchronised, so equal to the full-batch ones.
    assert max_diff(state.model_state, ref_state) < 1e-6
    assert max_diff(state.model_state, pmap_state) < 1e-6


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_gradient_is_not_summed_over_devices(mesh):
    """The gradient trap: without the varying cast the update is N times too large."""
    model = models.pytree()
    b = models.batch(64)
    state, _ = train(jddp.DataParallel(model.loss_fn, optax.sgd(1.0), mesh=mesh), model, [b])
    grads = jax.grad(lambda p: model.loss_fn(p, {}, b, None)[0])(model.params)
    expected = jax.tree.map(lambda p, g: p - g, model.params, grads)
    too_large = jax.tree.map(lambda p, g: p - N * g, model.params, grads)
    assert max_diff(state.params, expected) < 1e-6
    assert max_diff(state.params, too_large) > 1e-2


def test_accumulate_steps_equals_whole_batch(mesh):
    model = models.pytree()
    batches = [models.batch(64, seed) for seed in range(3)]
    whole, _ = train(jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh), model, batches)
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh, accumulate_steps=4)
    accumulated, _metrics = train(dp, model, batches)
    assert max_diff(whole.params, accumulated.params) < 1e-6
    report = dp.comm_report(accumulated, batches[0])
    assert report.count("all-reduce") == 1
    (allreduce,) = report.collectives
    assert not allreduce.in_loop


@pytest.mark.parametrize("accumulate_steps", [3, 4])
def test_evaluate_takes_any_batch_the_devices_divide_whatever_the_accumulation(mesh, accumulate_steps):
    """An evaluation takes its batch whole: a batch the devices divide but the micro-batches do not (a loader with
    ``max_per_device_batch_size`` pads the evaluation's batch for the devices only) evaluates as the step-free
    ``DataParallel`` does; the step still refuses it, naming ``accumulate_steps``."""
    model = models.pytree()
    batch = models.batch(N * 5, 0)  # 40 rows: 8 devices divide it, 8 x 3 and 8 x 4 do not
    plain = jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh)
    accumulated = jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh, accumulate_steps=accumulate_steps)
    state = accumulated.init(model.params, model.model_state, rng=0)
    reference = plain.evaluate(plain.init(model.params, model.model_state, rng=0), [batch])
    assert accumulated.evaluate(state, [batch]) == reference
    with pytest.raises(ValueError, match=f"accumulate_steps={accumulate_steps}"):
        accumulated.step(state, batch)


def test_accumulate_with_uneven_masks_is_exact(mesh):
    model = models.pytree()
    mask = np.zeros(64, np.float32)
    mask[[0, 1, 2, 9, 30, 31, 40, 41, 42, 43, 44, 63]] = 1
    b = models.batch(64, mask=mask)
    whole, m1 = train(jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh), model, [b])
    acc, m4 = train(jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh, accumulate_steps=2), model, [b])
    assert max_diff(whole.params, acc.params) < 1e-6
    assert abs(float(m1["loss"]) - float(m4["loss"])) < 1e-6


@pytest.mark.parametrize("kind", ["nnx-rngs", "int-counter"])
def test_accumulate_steps_keeps_integer_model_state_that_every_device_computes_alike(mesh, kind):
    """An NNX model holding ``nnx.Rngs`` (any ``nnx.Dropout(rate, rngs=rngs)``) keeps uint32 stream counters in
    its model state, and a model may count its calls in an integer. With ``accumulate_steps`` they were cast to
    varying for the scan and then refused as "differs across devices"; now they train as with one micro-batch
    (dropout off, so the gradients are the same), and the counter counts the model's calls."""
    from flax import nnx

    rs = np.random.RandomState(0)
    batch = {"x": rs.randn(32, 6).astype(np.float32), "y": rs.randint(0, 3, 32).astype(np.int32)}
    xent = lambda logits, b: jddp.masked_mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]), b.get("mask")
    )
    if kind == "nnx-rngs":

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.l1, self.drop = nnx.Linear(6, 16, rngs=rngs), nnx.Dropout(0.0, rngs=rngs)
                self.l2 = nnx.Linear(16, 3, rngs=rngs)

            def __call__(self, x):
                return self.l2(self.drop(nnx.relu(self.l1(x))))

        graphdef, params, model_state = jddp.models.nnx_split(Net(nnx.Rngs(0)))
        loss_fn = jddp.models.nnx_loss(graphdef, lambda model, b, rng: xent(model(b["x"]), b))
    else:

        def loss_fn(params, model_state, b, rng):
            return xent(b["x"] @ params["w"], b), ({"calls": model_state["calls"] + 1}, {})

        params, model_state = {"w": rs.randn(6, 3).astype(np.float32)}, {"calls": np.zeros((), np.int32)}
    states = {}
    for k in (1, 2):
        dp = jddp.DataParallel(loss_fn, optax.sgd(LR), mesh=mesh, accumulate_steps=k)
        states[k], _ = dp.step(dp.init(params, model_state), batch)
        jax.block_until_ready(states[k])
    assert max_diff(states[1].params, states[2].params) < 1e-6
    if kind == "int-counter":
        assert int(states[1].model_state["calls"]) == 1 and int(states[2].model_state["calls"]) == 2


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_uneven_masks_give_exact_global_mean(mesh):
    model = models.pytree()
    # 8 devices x 8 rows: device 0 full, device 1 empty, the rest uneven.
    real = [8, 0, 3, 1, 5, 8, 2, 7]
    mask = np.concatenate([np.arange(8) < r for r in real]).astype(np.float32)
    b = models.batch(64, seed=4, mask=mask)
    state, metrics = train(jddp.DataParallel(model.loss_fn, optax.sgd(1.0), mesh=mesh), model, [b])

    real_rows = {k: v[mask == 1] for k, v in b.items() if k != "mask"}
    loss, grads = jax.value_and_grad(lambda p: model.loss_fn(p, {}, real_rows, None)[0])(model.params)
    expected = jax.tree.map(lambda p, g: p - g, model.params, grads)
    assert max_diff(state.params, expected) < 1e-6
    assert metrics["examples"] == mask.sum()
    assert abs(float(metrics["loss"]) - float(loss)) < 1e-6
    logits = np.tanh(real_rows["x"] @ model.params["w1"]) @ model.params["w2"]
    accuracy = np.mean(np.argmax(logits, -1) == real_rows["y"])
    assert abs(float(metrics["accuracy"]) - accuracy) < 1e-6
    # DDP's average of per-device averages is measurably different here.
    local = [jax.tree.map(lambda x, i=i: x[8 * i : 8 * i + 8], b) for i in range(N) if real[i]]
    naive = np.mean([float(model.loss_fn(model.params, {}, lb, None)[0]) for lb in local])
    assert abs(naive - float(loss)) > 1e-3


def test_weighted_loss_is_exact(mesh):
    """A `jddp.Weighted` loss (a sum over tokens) gives the global per-token mean."""
    rng = np.random.default_rng(0)
    tokens = rng.normal(size=(32, 6)).astype(np.float32)
    lengths = rng.integers(0, 7, size=32)
    valid = (np.arange(6)[None, :] < lengths[:, None]).astype(np.float32)

    def loss_fn(params, model_state, batch, rng):
        per_token = (batch["t"] * params["w"] - 1.0) ** 2 * batch["valid"]
        return jddp.Weighted(per_token.sum(), batch["valid"].sum()), (model_state, {})

    dp = jddp.DataParallel(loss_fn, optax.sgd(1.0), mesh=mesh)
    state = dp.init({"w": np.float32(0.5)})
    state, metrics = dp.step(state, {"t": tokens, "valid": valid})
    w = 0.5
    expected_loss = np.sum((tokens * w - 1) ** 2 * valid) / valid.sum()
    expected_grad = np.sum(2 * (tokens * w - 1) * tokens * valid) / valid.sum()
    assert abs(float(metrics["loss"]) - expected_loss) < 1e-5
    assert abs(float(state.params["w"]) - (w - expected_grad)) < 1e-6


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_batchnorm_statistics_equal_full_batch(mesh, kind):
    """The running statistics after one step, against NumPy over the whole global batch (momentum 0.9)."""
    model = models.FACTORIES[kind]()
    b = models.batch(64, seed=7)
    state, _ = train(jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh), model, [b])
    if kind == "nnx":
        dense, bn = model.params["l1"], state.model_state["bn"]
    else:
        dense, bn = model.params["Dense_0"], state.model_state["batch_stats"]["BatchNorm_0"]
    pre = b["x"] @ np.asarray(dense["kernel"]) + np.asarray(dense["bias"])
    np.testing.assert_allclose(np.asarray(bn["mean"]), 0.1 * pre.mean(0), atol=1e-6)
    np.testing.assert_allclose(np.asarray(bn["var"]), 0.9 + 0.1 * pre.var(0), atol=1e-6)
    jddp.engine.replicas.assert_identical(state.model_state)


def test_unsynchronised_model_state_is_averaged(mesh):
    """Model state computed per device (no axis name) is averaged over replicas."""

    def loss_fn(params, model_state, batch, rng):
        return jnp.mean((batch["x"] * params["w"]) ** 2), ({"m": jnp.mean(batch["x"])}, {})

    x = np.arange(64, dtype=np.float32)
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.0), mesh=mesh)
    state, _ = dp.step(dp.init({"w": np.float32(1)}, {"m": np.float32(0)}), {"x": x})
    assert float(state.model_state["m"]) == pytest.approx(x.mean())


def test_replicas_bit_identical_after_10_steps(mesh):
    model = models.nnx_model()
    dp = jddp.DataParallel(model.loss_fn, optax.adamw(1e-2), mesh=mesh, clip_grad_norm=1.0)
    state, _ = train(dp, model, [models.batch(64, s) for s in range(10)])
    assert int(state.step) == 10
    for leaf in jax.tree.leaves(state):
        shards = [np.asarray(s.data).tobytes() for s in leaf.addressable_shards]
        assert len(shards) == N and len(set(shards)) == 1
    dp.assert_replicas_identical(state)


def test_replica_check_detects_a_difference(mesh):
    devices = mesh.devices.tolist()
    parts = [jax.device_put(np.float32(1.0 if i != 5 else 1.0 + 1e-7), d) for i, d in enumerate(devices)]
    leaf = jax.make_array_from_single_device_arrays((), jddp.replicated(mesh), parts)
    with pytest.raises(AssertionError, match=r"Replicas differ at state\['w'\]: device .*5"):
        jddp.engine.replicas.assert_identical({"w": leaf})


@pytest.mark.parametrize("mode", ["device", "example"])
def test_rng_differs_per_step_and_per_device_only_when_asked(mesh, mode):
    """``rng="device"``: the classic key per device (the step and the device index folded in). ``rng="example"``
    (the default): the same key on every device, so a draw that is not per example (a scalar here) is the same
    on every device, as on one device."""

    def loss_fn(params, model_state, batch, rng):
        u = jax.random.uniform(rng)
        return jnp.mean(batch["x"]) * params["w"], (model_state, {"u": u, "u2": u * u})

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.0), mesh=mesh, rng=mode)
    state = dp.init({"w": np.float32(1)}, rng=jax.random.key(42))
    base = jax.random.key(42)
    expected = []
    for step in range(2):
        key = jax.random.fold_in(base, step)
        us = [float(jax.random.uniform(jax.random.fold_in(key, d) if mode == "device" else key)) for d in range(N)]
        expected.append(np.mean(us))
        assert len(set(us)) == (N if mode == "device" else 1)
    assert expected[0] != expected[1]
    got = []
    for _ in range(2):
        state, metrics = dp.step(state, {"x": np.ones(16, np.float32)})
        got.append(float(metrics["u"]))
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_clip_grad_norm_after_averaging(mesh):
    model = models.pytree()
    b = models.batch(64)
    state, metrics = train(jddp.DataParallel(model.loss_fn, optax.sgd(1.0), mesh=mesh, clip_grad_norm=0.01), model, [b])
    grads = jax.grad(lambda p: model.loss_fn(p, {}, b, None)[0])(model.params)
    norm = float(optax.tree.norm(grads))
    assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)
    assert norm > 0.01
    expected = jax.tree.map(lambda p, g: p - g * (0.01 / norm), model.params, grads)
    assert max_diff(state.params, expected) < 1e-6


@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["replicated", "zero"])
def test_float16_reduce_sums_means_not_totals(mesh, shard_optimizer):
    """``reduce_dtype=jnp.float16`` (DDP's fp16 compression hook): a mean gradient of 320 over 256 examples on 8
    devices has a total of 81920, over float16's 65504. The sum travels as per-device means and the step equals
    float32's to float16's rounding; before, every such step overflowed and was skipped as non-finite."""
    loss_fn = lambda p, ms, b, rng: (jddp.masked_mean((b["x"] @ p["w"] - b["y"]) ** 2, b.get("mask")), (ms, {}))
    rs = np.random.RandomState(0)
    b = {"x": np.full((256, 4), 10.0, np.float32) + rs.rand(256, 4).astype(np.float32), "y": np.zeros(256, np.float32)}
    results = {}
    for wire in (None, jnp.float16):
        dp = jddp.DataParallel(loss_fn, optax.sgd(1e-5), mesh=mesh, reduce_dtype=wire, shard_optimizer=shard_optimizer)
        results[wire], m = dp.step(dp.init({"w": np.full((4,), 0.4, np.float32)}), b)
        assert float(m["nonfinite"]) == 0.0 and float(m["grad_norm"]) > 600
    grad = np.mean(2 * (b["x"] @ np.full(4, 0.4, np.float32))[:, None] * b["x"], axis=0)
    expected = 0.4 - 1e-5 * grad
    np.testing.assert_allclose(np.asarray(results[None].params["w"]), expected, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(results[jnp.float16].params["w"]), expected, rtol=2e-7, atol=1e-5 * 0.5)


def nan_loss_fn(params, model_state, batch, rng):
    loss = jnp.mean((batch["x"] * params["w"]) ** 2) / batch["scale"][0]
    return loss, ({"seen": model_state["seen"] + 1.0}, {})


def test_nonfinite_step_is_skipped_on_every_replica(mesh):
    dp = jddp.DataParallel(nan_loss_fn, optax.adam(0.1), mesh=mesh)
    state = dp.init({"w": np.float32(2)}, {"seen": np.float32(0)})
    ok = {"x": np.ones(16, np.float32), "scale": np.ones(16, np.float32)}
    bad = {"x": np.ones(16, np.float32), "scale": np.zeros(16, np.float32)}
    state, m = dp.step(state, ok)
    before = jax.tree.map(np.asarray, (state.params, state.opt_state, state.model_state))
    state, m = dp.step(state, bad)
    assert float(m["nonfinite"]) == 1.0 and int(state.step) == 2
    after = jax.tree.map(np.asarray, (state.params, state.opt_state, state.model_state))
    assert max_diff(before, after) == 0.0
    dp.assert_replicas_identical(state)
    state, m = dp.step(state, ok)
    assert float(m["nonfinite"]) == 0.0 and float(state.model_state["seen"]) == 2.0


def test_nonfinite_raise_names_the_step(mesh):
    dp = jddp.DataParallel(nan_loss_fn, optax.sgd(0.1), mesh=mesh, nonfinite="raise")
    state = dp.init({"w": np.float32(2)}, {"seen": np.float32(0)})
    bad = {"x": np.ones(16, np.float32), "scale": np.zeros(16, np.float32)}
    with pytest.raises(jddp.NonFiniteError, match=r"step=0 .*update was skipped") as info:
        dp.step(state, bad)
    assert float(info.value.state.params["w"]) == 2.0


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "per-leaf"])
def test_bf16_reduce_puts_bf16_on_the_wire_and_rounds(mesh, fuse):
    """The program asks for a bf16 all-reduce of the gradients (checked before XLA:CPU widens it back)."""
    model = models.pytree()
    b = models.batch(64)
    f32, _ = train(jddp.DataParallel(model.loss_fn, optax.sgd(1.0), mesh=mesh), model, [b])
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(1.0), mesh=mesh, reduce_dtype=jnp.bfloat16, fuse_allreduce=fuse)
    bf16, _ = train(dp, model, [b])
    diff = max_diff(f32.params, bf16.params)
    assert 1e-7 < diff < 1e-2
    report = dp.comm_report(bf16, b)
    grad_elements = sum(x.size for x in jax.tree.leaves(model.params))
    elements: dict[str, int] = {}
    for c in report.lowered:
        for dtype, shape in c.operands if c.op == "all-reduce" else ():
            elements[dtype] = elements.get(dtype, 0) + int(np.prod(shape))
    assert set(elements) == {"bf16", "f32"}, report.lowered
    assert elements["bf16"] == grad_elements  # every gradient element in bf16, once
    assert elements["f32"] <= 6  # only the scalars (loss, counts, metric totals) stay f32
    assert report.count("all-reduce") == 1
    if jax.default_backend() == "cpu":
        assert "widens a bf16 all-reduce to f32" in str(report)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "per-leaf"])
def test_comm_report_moves_exactly_the_gradient_bytes(mesh, fuse):
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh, fuse_allreduce=fuse)
    state = dp.init(model.params)
    report = dp.comm_report(state, models.batch(64))
    grad_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
    assert report.count("all-reduce") == 1 and len(report.collectives) == 1
    (allreduce,) = report.collectives
    assert all(d == "f32" for d, _ in allreduce.operands)
    if fuse:  # one flat buffer: the gradient elements and at most 6 scalars (loss, counts, metrics)
        ((_, (size,)),) = allreduce.operands
        assert grad_bytes < 4 * size <= grad_bytes + 4 * 6
        assert allreduce.nbytes == 4 * size
    else:  # one operand per leaf
        arrays = [(d, s) for d, s in allreduce.operands if s]
        scalars = [(d, s) for d, s in allreduce.operands if not s]
        assert sorted(s for _, s in arrays) == sorted(np.shape(x) for x in jax.tree.leaves(model.params))
        assert allreduce.nbytes == grad_bytes + 4 * len(scalars) and len(scalars) <= 6
    table = str(report)
    assert "all-reduce" in table and f"{allreduce.nbytes:,}" in table


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_fused_and_per_leaf_all_reduce_train_alike(mesh):
    """The fused buffer sums the same numbers: params equal the per-leaf path's (bf16 wire and BatchNorm too)."""
    for kind, wire in (("linen", None), ("pytree", jnp.bfloat16)):
        model = models.FACTORIES[kind]()
        batches = [models.batch(64, seed) for seed in range(3)]
        runs = [
            train(jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh, reduce_dtype=wire, fuse_allreduce=f),
                  model, batches)[0]
            for f in (True, False)
        ]  # fmt: skip
        assert max_diff(runs[0].params, runs[1].params) < 1e-6
        assert max_diff(runs[0].model_state, runs[1].model_state) < 1e-6
        assert max_diff(runs[0].params, model.params) > 1e-2


def test_second_step_does_not_recompile(mesh):
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh)
    state = dp.init(model.params)
    with models.counting_compiles() as compiles:
        state, _ = dp.step(state, models.batch(64, 0))
        first = len(compiles)
        for seed in range(1, 4):
            state, _ = dp.step(state, models.batch(64, seed))
        jax.block_until_ready(state)
    assert first >= 1 and len(compiles) == first


def test_state_is_donated_and_caller_arrays_survive(mesh):
    model = models.pytree()
    params = jax.tree.map(jnp.asarray, model.params)
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh)
    state = dp.init(params)
    old_w1 = state.params["w1"]
    new_state, _ = dp.step(state, models.batch(64))
    jax.block_until_ready(new_state)
    assert old_w1.is_deleted()
    np.testing.assert_array_equal(np.asarray(params["w1"]), model.params["w1"])


def test_a_state_donated_while_a_numpy_view_holds_it_is_refused_not_run_again(mesh):
    """A NumPy view of a state (``np.asarray``, ``jax.device_get``: zero-copy on CPU; the Checkpointer pins its
    buffers so) keeps JAX from donating device 0's buffers: the other devices' are donated, and ``is_deleted()``
    stayed False. Stepping that state again executed donated buffers: XLA's "Buffer has been deleted or donated",
    then a segmentation fault (the generated ``jddp.fit`` test died so). Now the old state reads as donated and
    every reuse is jddp's error naming ``state``; the views keep the values they saw."""
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh)
    state = dp.init(model.params)
    views = jax.tree.map(np.asarray, state)  # alive across the step, as a host copy kept for logging would be
    new_state, _ = dp.step(state, models.batch(64))
    assert state.step.is_deleted()
    for reuse in (dp.step, dp.eval_step, dp.comm_report):
        with pytest.raises(ValueError, match=r"`state` was donated to an earlier step"):
            reuse(state, models.batch(64))
    with pytest.raises(ValueError, match=r"`state` was donated to an earlier step"):
        dp.check_replicas(state)
    new_state, _ = dp.step(new_state, models.batch(64, 1))  # the new state trains on
    assert int(new_state.step) == 2
    assert max_diff(views.params, model.params) == 0
    assert int(views.step) == 0


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_eval_step_exact_over_padded_batch(mesh):
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh)
    state = dp.init(model.params)
    data = models.batch(50, seed=9)
    padded = {k: np.concatenate([v, v[:14]]) for k, v in data.items()}
    padded["mask"] = (np.arange(64) < 50).astype(np.float32)
    metrics = dp.eval_step(state, padded)
    loss, (_, aux) = model.loss_fn(model.params, {}, data, None)
    assert float(metrics["examples"]) == 50
    assert abs(float(metrics["loss"]) - float(loss)) < 1e-6
    assert abs(float(metrics["accuracy"]) - float(aux["accuracy"])) < 1e-6
    # Switching between step and eval_step (two collective programs) does not deadlock.
    for _ in range(3):
        state, _ = dp.step(state, padded)
        metrics = dp.eval_step(state, padded)
    assert float(metrics["examples"]) == 50


def test_many_steps_in_flight_do_not_deadlock(mesh):
    """Hundreds of undrained dispatches abort XLA:CPU; the dispatcher bounds them."""
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(1e-3), mesh=mesh)
    state = dp.init(model.params)
    b = jax.device_put(models.batch(64), jddp.batch_sharding(mesh))
    for _ in range(400):
        state, _metrics = dp.step(state, b)
    assert int(state.step) == 400


def test_nonfinite_ignore_applies_the_update(mesh):
    dp = jddp.DataParallel(nan_loss_fn, optax.sgd(0.1), mesh=mesh, nonfinite="ignore")
    state = dp.init({"w": np.float32(2)}, {"seen": np.float32(0)})
    state, metrics = dp.step(state, {"x": np.ones(16, np.float32), "scale": np.zeros(16, np.float32)})
    assert "nonfinite" not in metrics and "grad_norm" not in metrics
    assert not np.isfinite(float(state.params["w"]))


def test_metrics_are_read_once_and_name_clashes_raise(mesh):
    def loss_fn(params, model_state, batch, rng):
        return jnp.mean(batch["x"]) * params["w"], (model_state, {"examples": jnp.float32(1)})

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match=r"Metric names \['examples'\] are reserved"):
        dp.step(dp.init({"w": np.float32(1)}), {"x": np.ones(8, np.float32)})
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=mesh)
    _, metrics = dp.step(dp.init(model.params), models.batch(64))
    assert list(metrics) == ["loss", "examples", "grad_norm", "nonfinite", "accuracy"]
    assert isinstance(metrics["loss"], float) and metrics.packed.shape == (10,)  # the values, then their weights
    assert metrics.weights["loss"] == metrics.weights["accuracy"] == metrics["examples"]
    with pytest.raises(KeyError, match=r"No metric 'acc'; the metrics are"):
        metrics["acc"]


def test_bad_fuse_allreduce(mesh):
    model = models.pytree()
    with pytest.raises(ValueError, match=r"`fuse_allreduce` must be True, False or None .*fuse_allreduce='yes'"):
        jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh, fuse_allreduce="yes")


def test_fused_psum_packs_small_leaves_and_leaves_large_ones_alone(mesh):
    """Small leaves of a dtype share one buffer, a leaf above `max_leaf_bytes` is its own operand; sums as psum's."""
    from jax.sharding import PartitionSpec as P

    from jddp.engine import comm, fused

    rng = np.random.default_rng(0)
    tree = {
        "big": rng.normal(size=(N, 300, 1000)).astype(np.float32),  # 1.2 MB per device
        "mid": rng.normal(size=(N, 200, 1000)).astype(np.float32),  # 0.8 MB per device: packed
        "w": rng.normal(size=(N, 3, 4)).astype(np.float32),
        "n": rng.integers(0, 9, size=(N,)).astype(np.int32),
        "s": rng.normal(size=(N,)).astype(np.float32),
    }

    def reduce(fn):
        body = lambda t: fn(jax.tree.map(lambda x: x[0], t), "data")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))

    fused_fn = reduce(fused.fused_psum)
    got, want = fused_fn(tree), reduce(jax.lax.psum)(tree)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), got) == jax.tree.map(lambda x: (x.shape, x.dtype), want)
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6), got, want)
    np.testing.assert_array_equal(got["n"], tree["n"].sum(0))
    report = comm.CommReport.from_hlo(fused_fn.lower(tree).compile().as_text())
    operands = sorted(op for c in report.collectives for op in c.operands)
    assert operands == [("f32", (300, 1000)), ("f32", (200_013,)), ("s32", (1,))]


def test_default_packs_the_all_reduce_in_one_process_unless_a_leaf_is_large(mesh):
    """``fuse_allreduce=None`` within one process: one packed operand for small leaves; one operand per leaf
    when a leaf is over 1 MiB (beside it, the packed buffer made the step 2.5x slower; ``jddp.engine.fused``)."""
    rng = np.random.default_rng(0)
    loss_fn = lambda p, ms, b, r: (jddp.masked_mean(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]), (ms, {}))
    batch = {"x": rng.normal(size=(64, 12)).astype(np.float32)}
    for width, packed in ((16, True), (1 << 15, False)):  # w1 of 12 x 2^15 float32: 1.5 MiB
        params = {"w1": rng.normal(size=(12, width)).astype(np.float32), "w2": np.ones((width, 2), np.float32)}
        dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
        report = dp.comm_report(dp.init(params), batch)
        (allreduce,) = [c for c in report.collectives if c.op.startswith("all-reduce")]
        arrays = sorted(shape for _, shape in allreduce.operands if shape)
        if packed:
            assert len(allreduce.operands) == 1, allreduce
        else:
            assert arrays == sorted([(12, width), (width, 2)]), allreduce


def test_a_train_state_made_by_hand_is_checked_and_tree_functions_rebuild_it_unchecked(mesh):
    """``TrainState(...)`` and ``replace`` refuse a wrong field naming it; ``jax.tree.map`` (and every JAX tree
    function) rebuilds states with any leaves, under the same paths as before (``.step``, ``.params[...]``)."""
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(LR), mesh=mesh)
    state = dp.init(model.params)
    with pytest.raises(ValueError, match=r"`step` must be an integer scalar \(int32\), got shape=\(3,\)"):
        state.replace(step=jnp.ones(3, jnp.int32))
    with pytest.raises(
        TypeError, match=r"`rng` must be uint32\[2\] key data \(`jax.random.key_data\(key\)`\), got PRNGKeyArray"
    ):
        state.replace(rng=jax.random.key(0))
    with pytest.raises(TypeError, match=r"`model_state` must be a pytree of arrays \(`\{\}` when the model has none"):
        jddp.TrainState(state.step, state.params, state.opt_state, None, state.rng)
    with pytest.raises(TypeError, match=r"params\['act'\] is str"):
        state.replace(params={**state.params, "act": "relu"})
    with pytest.raises(ValueError, match=r"`params` holds no arrays"):
        state.replace(params={})
    shardings = jax.tree.map(lambda x: x.sharding, state)
    assert isinstance(shardings, jddp.TrainState) and shardings.step == dp._rep
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(state)]
    assert paths[0] == ".step" and ".params['w1']" in paths and paths[-1] == ".rng"
    assert jax.tree.map(lambda x: x, state).params["w1"] is state.params["w1"]


def test_masked_mean_refuses_what_is_not_an_array_of_one_leading_size():
    values, mask = jnp.array([1.0, 2.0, 9.0]), jnp.array([1, 1, 0])
    assert float(jddp.masked_mean(values, mask)) == 1.5
    assert float(jddp.masked_mean(np.asarray(values), np.asarray(mask))) == 1.5  # NumPy arrays are arrays
    with pytest.raises(TypeError, match=r"`values` must be an array .*got list"):
        jddp.masked_mean([1.0, 2.0, 9.0], mask)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`mask` must hold real numbers or bools, got dtype=<U1"):
        jddp.masked_mean(values, np.array(["1", "1", "0"]))
    with pytest.raises(ValueError, match=r"`mask` must be \[batch\] for `values` of shape \(3,\).*\(3, 1\)"):
        jddp.masked_mean(values, mask[:, None])
    gone = jnp.ones(3)
    gone.delete()
    with pytest.raises(ValueError, match=r"`values` was donated to an earlier step \(or deleted\)"):
        jddp.masked_mean(gone)
