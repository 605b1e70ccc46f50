"""ZeRO-1 (``DataParallel(shard_optimizer=True)``) against the replicated engine and one device."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.engine import zero
from jddp.runtime import dispatch, layout
from tests import models, multiprocess

N = 8
max_diff = models.max_diff


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < N:
        pytest.skip(f"needs {N} devices")
    return jddp.data_mesh()


def batches(count: int, n: int = 64, masked: bool = True, devices: int = N) -> list[dict]:
    return [models.batch(n, seed, models.uneven_mask(n, seed, devices) if masked else None) for seed in range(count)]


def train(dp, model, data, state=None):
    state = dp.init(model.params, model.model_state, rng=0) if state is None else state
    metrics = []
    for b in data:
        state, m = dp.step(state, b)
        metrics.append(dict(m))
    dispatch.DISPATCHER.drain()
    return state, metrics


def logical_opt_state(state):
    """The optimizer state without its padding, as host arrays."""
    if state.opt_layout is None:
        return jax.tree.map(np.asarray, state.opt_state)
    return jax.device_get(jax.jit(lambda s: zero.unpad(state.opt_layout, s))(state.opt_state))


OPTIMIZERS = {
    "sgd-momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adamw-clip": lambda: optax.adamw(3e-3, weight_decay=0.1),
}


MAKERS = {"pytree": models.pytree, "odd": models.odd, "linen-bn": models.linen}
# Every pair of (model, optimizer), (model, accumulation) and (optimizer, accumulation) once: 6 cases of the 12.
PAIRWISE = [
    ("pytree", "sgd-momentum", 1),
    ("pytree", "adamw-clip", 4),
    ("odd", "sgd-momentum", 4),
    ("odd", "adamw-clip", 1),
    ("linen-bn", "sgd-momentum", 1),
    ("linen-bn", "adamw-clip", 4),
]


@pytest.mark.parametrize(
    ("make", "name", "accumulate"),
    [pytest.param(MAKERS[m], o, a, id=f"{m}-{o}-{'whole' if a == 1 else f'accumulate{a}'}") for m, o, a in PAIRWISE],
)
def test_equals_replicated_engine_after_20_steps(mesh, make, name, accumulate):
    """Params, optimizer state, model state (BatchNorm statistics) and every metric of 20 steps within 1e-6."""
    model = make()
    # Without clipping the two engines agree to the bit here. Clipping reads the global norm, which the split
    # engine sums in another order (1 ulp apart). The BatchNorm model's bias before BatchNorm has a gradient of 0
    # in exact arithmetic, round-off noise (1e-9) that Adam scales to whole learning-rate steps: with clipping its
    # noise, and then the BatchNorm means, differ by 1e-3 (as they would under any change of summation order), so
    # that model runs AdamW unclipped.
    clip = 0.5 if name == "adamw-clip" and make is not models.linen else None
    data = batches(20)
    runs = {}
    for shard in (False, True):
        dp = jddp.DataParallel(
            model.loss_fn, OPTIMIZERS[name](), mesh=mesh, accumulate_steps=accumulate, clip_grad_norm=clip,
            shard_optimizer=shard,
        )  # fmt: skip
        runs[shard] = train(dp, model, data)
    (rep, rep_metrics), (sharded, sharded_metrics) = runs[False], runs[True]
    assert max_diff(model.params, rep.params) > 1e-2  # training moved the parameters
    assert max_diff(rep.params, sharded.params) < 1e-6
    assert max_diff(logical_opt_state(rep), logical_opt_state(sharded)) < 1e-6
    assert max_diff(rep.model_state, sharded.model_state) < 1e-6
    for a, b in zip(rep_metrics, sharded_metrics, strict=True):
        assert a.keys() == b.keys()
        assert max(abs(a[k] - b[k]) for k in a) < 1e-5 * max(1.0, *(abs(v) for v in a.values()))
    if clip is not None:  # clipping was active, so the global norm of the split gradient was used
        assert max(m["grad_norm"] for m in rep_metrics) > clip


def test_equals_one_device_adamw(mesh):
    """An independent reference: AdamW on one device over whole global batches, no jddp."""
    model = models.pytree()
    data = batches(10, masked=False)
    optimizer = optax.adamw(1e-2, weight_decay=0.1)
    state, _ = train(jddp.DataParallel(model.loss_fn, optimizer, mesh=mesh, shard_optimizer=True), model, data)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: model.loss_fn(p, {}, batch, None)[0])(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = model.params, optimizer.init(model.params)
    for b in data:
        params, opt_state = step(params, opt_state, b)
    assert max_diff(model.params, params) > 1e-2
    assert max_diff(state.params, params) < 1e-6
    assert max_diff(logical_opt_state(state), opt_state) < 1e-6


def test_layout_choice():
    assert layout.choose((12, 16), 8) == layout.LeafLayout((12, 16), 1, 16)  # the dimension 8 divides
    assert layout.choose((16, 24), 8) == layout.LeafLayout((16, 24), 1, 24)  # the largest of those
    assert layout.choose((16, 16), 8) == layout.LeafLayout((16, 16), 0, 16)  # the first of equals
    assert layout.choose((12, 20), 8) == layout.LeafLayout((12, 20), 1, 24)  # none: the largest, padded
    assert layout.choose((8, 20), 8) == layout.LeafLayout((8, 20), 0, 8)  # divisible before larger: no padding
    assert layout.choose((5,), 8) == layout.LeafLayout((5,), 0, 8)
    assert layout.choose((2,), 8) == layout.LeafLayout((2,), 0, 8)  # two elements: one per device, padded
    assert layout.choose((512, 1024), 6) == layout.LeafLayout((512, 1024), 1, 1026)
    for shape in [(), (1,), (1, 1)]:
        assert layout.choose(shape, 8) == layout.LeafLayout(shape)  # scalars and single elements: replicated
    assert layout.choose((12, 16), 1) == layout.LeafLayout((12, 16))  # one device: nothing to split
    lay = layout.choose((3, 5), 4)
    assert lay.stored_shape == (3, 8) and lay.padded and lay.spec() == jax.sharding.PartitionSpec(None, "data")
    x = jnp.arange(15.0).reshape(3, 5)
    padded = lay.pad(x)
    assert padded.shape == (3, 8) and float(jnp.abs(padded[:, 5:]).sum()) == 0.0
    assert np.array_equal(lay.unpad(padded), x)


def test_state_is_split_and_padded_as_laid_out(mesh):
    model = models.odd()
    dp = jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh, shard_optimizer=True)
    state = dp.init(model.params)
    mu = state.opt_state[0].mu
    assert mu["w1"].shape == (12, 24) and mu["w1"].sharding.spec == jax.sharding.PartitionSpec(None, "data")
    assert mu["b2"].shape == (8,) and [s.data.shape for s in mu["b2"].addressable_shards] == [(1,)] * N
    assert state.opt_state[0].count.is_fully_replicated
    assert all(x.is_fully_replicated for x in jax.tree.leaves(state.params))
    state, _ = dp.step(state, models.batch(64))
    assert state.opt_state[0].mu["w1"].sharding.spec == jax.sharding.PartitionSpec(None, "data")
    assert float(jnp.abs(state.opt_state[0].mu["w1"][:, 20:]).sum()) == 0.0  # the padding stays zero


def test_optimizer_state_bytes_per_device_fall_as_one_over_n():
    """Measured from the live buffers: every split leaf holds 1/N of its bytes on each device."""
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(64, 128)).astype(np.float32), "b1": np.zeros(128, np.float32),
              "w2": rng.normal(size=(128, 16)).astype(np.float32), "b2": np.zeros(16, np.float32)}  # fmt: skip
    loss_fn = models.pytree().loss_fn
    total = 2 * sum(x.nbytes for x in params.values())  # AdamW's two moments; plus its int32 step count
    measured = {}
    for n in (1, 2, 4, 8):
        dp = jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=jddp.data_mesh(jax.devices()[:n]), shard_optimizer=True)
        per_device = zero.state_bytes(dp.init(params).opt_state)
        assert len(per_device) == n and len(set(per_device.values())) == 1
        measured[n] = next(iter(per_device.values()))
        assert measured[n] == total // n + 4
    replicated = jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=jddp.data_mesh())
    assert set(zero.state_bytes(replicated.init(params).opt_state).values()) == {total + 4}


def test_comm_report_reduce_scatter_and_all_gather_send_the_all_reduce_bytes(mesh):
    """No gradient all-reduce: one reduce-scatter and one all-gather per leaf, sending together the all-reduce's
    ring bytes (the scalars' all-reduce aside)."""
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(12, 16)).astype(np.float32), "w2": rng.normal(size=(16, 8)).astype(np.float32)}
    loss_fn = lambda p, ms, b, r: (jddp.masked_mean(jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]), (ms, {}))
    batch = {"x": rng.normal(size=(64, 12)).astype(np.float32)}
    grad_bytes = sum(x.nbytes for x in params.values())
    reports = {}
    for shard in (False, True):
        dp = jddp.DataParallel(
            loss_fn, optax.adam(1e-3), mesh=mesh, shard_optimizer=shard, clip_grad_norm=1.0, fuse_allreduce=False
        )
        reports[shard] = dp.comm_report(dp.init(params), batch)
    rep, sharded = reports[False], reports[True]
    ring = 2 * (N - 1) / N
    # + the loss total; the example count of a batch without a mask is a compile-time constant, summed without
    # a collective.
    assert rep.count("all-reduce") == 1 and rep.nbytes("all-reduce") == grad_bytes + 4
    assert sharded.count("reduce-scatter") == 2 and sharded.count("all-gather") == 2
    assert sharded.nbytes("reduce-scatter") == grad_bytes // N  # each device receives its slice
    assert sharded.nbytes("all-gather") == grad_bytes  # and gathers every new parameter
    assert sharded.wire_bytes("reduce-scatter") + sharded.wire_bytes("all-gather") == ring * grad_bytes
    assert rep.wire_bytes() == ring * (grad_bytes + 4)
    # What remains all-reduced are scalars: loss, count and the partial squares of the global norm.
    assert 0 < sharded.nbytes("all-reduce") <= 16
    assert all(c.group_size == N for c in sharded.collectives)
    assert "reduce-scatter" in str(sharded) and "sent per device" in str(sharded)


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_checkpoint_restores_onto_two_devices_and_into_the_replicated_engine(mesh, tmp_path):
    """Saved split over 8 devices (padded leaves included); restored onto 2 devices and into the replicated
    engine; each continues the uninterrupted run's trajectory within 1e-6. And back: replicated to split."""
    model = models.odd()
    data = batches(8, n=48)  # 48 examples: every device count here divides it
    optimizer = lambda: optax.adamw(3e-3, weight_decay=0.1)
    engine = lambda shard, n: jddp.DataParallel(
        model.loss_fn, optimizer(), mesh=jddp.data_mesh(jax.devices()[:n]), shard_optimizer=shard, clip_grad_norm=0.5
    )
    split8 = engine(True, 8)  # one engine for both runs: one compilation
    whole, _ = train(split8, model, data)
    half, _ = train(split8, model, data[:4])
    with jddp.Checkpointer(tmp_path / "split") as ckpt:
        ckpt.save(half, wait=True)
    rep8 = engine(False, 8)
    for shard, n, dp in ((True, 2, engine(True, 2)), (False, 8, rep8), (True, 6, engine(True, 6))):
        with jddp.Checkpointer(tmp_path / "split") as ckpt:
            restored = ckpt.restore_or_init(dp.init(model.params, rng=0))
        assert int(restored.step) == 4
        assert max_diff(logical_opt_state(restored), logical_opt_state(half)) == 0.0
        resumed, _ = train(dp, model, data[4:], restored)
        assert max_diff(resumed.params, whole.params) < 1e-6, (shard, n)
    rep_half, _ = train(rep8, model, data[:4])
    with jddp.Checkpointer(tmp_path / "replicated") as ckpt:
        ckpt.save(rep_half, wait=True)
    dp = engine(True, 4)
    with jddp.Checkpointer(tmp_path / "replicated") as ckpt:
        restored = ckpt.restore_or_init(dp.init(model.params, rng=0))
    assert restored.opt_layout is not None and restored.opt_state[0].mu["b1"].shape == (20,)  # 20 = 5 x 4
    resumed, _ = train(dp, model, data[4:], restored)
    assert max_diff(resumed.params, whole.params) < 1e-6


def test_nonfinite_step_is_skipped_identically(mesh):
    model = models.pytree()
    data = batches(4)
    data[2] = {**data[2], "x": np.where(np.arange(64)[:, None] == 40, np.nan, data[2]["x"]).astype(np.float32)}
    runs = {}
    for shard in (False, True):
        dp = jddp.DataParallel(model.loss_fn, optax.adamw(1e-2), mesh=mesh, shard_optimizer=shard)
        runs[shard] = train(dp, model, data)
    (rep, rep_m), (sharded, sharded_m) = runs[False], runs[True]
    assert [m["nonfinite"] for m in sharded_m] == [0.0, 0.0, 1.0, 0.0] == [m["nonfinite"] for m in rep_m]
    assert max_diff(rep.params, sharded.params) < 1e-6
    assert max_diff(logical_opt_state(rep), logical_opt_state(sharded)) < 1e-6
    assert np.isfinite(logical_opt_state(sharded)[0].mu["w1"]).all()


def test_bf16_reduction_scatters_bf16(mesh):
    model = models.pytree()
    data = batches(3)
    runs = {}
    for shard in (False, True):
        dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=mesh, reduce_dtype=jnp.bfloat16,
                               shard_optimizer=shard)  # fmt: skip
        runs[shard] = train(dp, model, data)[0]
    assert max_diff(runs[False].params, runs[True].params) < 1e-6
    state = runs[True]
    lowered = dp.comm_report(state, data[0]).lowered
    scattered = [d for c in lowered if c.op == "reduce-scatter" for d, _ in c.operands]
    assert scattered and set(scattered) == {"bf16"}


def test_no_recompilation_donation_and_eval(mesh):
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh, shard_optimizer=True)
    state = dp.init(model.params)
    with models.counting_compiles() as compiles:
        state, _ = dp.step(state, models.batch(64, 0))
        first = len(compiles)
        for seed in range(1, 4):
            old = state
            state, _ = dp.step(state, models.batch(64, seed))
            assert old.opt_state[0].mu["w1"].is_deleted()  # donated: updated in place
        jax.block_until_ready(state)
    assert first >= 1 and len(compiles) == first
    rep = jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh)
    b = models.batch(64, 9, mask=models.uneven_mask(64, 9, N))
    rep_state = rep.init(model.params)
    rep_state = rep_state.replace(params=jax.tree.map(lambda x: x + 0, state.params))
    assert dp.eval_step(state, b)["loss"] == pytest.approx(rep.eval_step(rep_state, b)["loss"], abs=1e-6)
    dp.check_replicas(state)  # the replicated leaves agree; split ones have no replicas to compare


def test_states_of_the_other_engine_or_device_count_are_refused(mesh):
    model = models.pytree()
    b = models.batch(64)
    sharded = jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh, shard_optimizer=True)
    replicated = jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh)
    with pytest.raises(ValueError, match=r"holds replicated optimizer state.*shard_optimizer=True.*Checkpointer"):
        sharded.step(replicated.init(model.params), b)
    with pytest.raises(ValueError, match=r"holds sharded optimizer state.*Checkpointer"):
        replicated.step(sharded.init(model.params), b)
    other = jddp.DataParallel(model.loss_fn, optax.sgd(0.1, momentum=0.9), mesh=mesh, shard_optimizer=True)
    with pytest.raises(ValueError, match=r"laid out for another model or device count.*leaf 0"):
        other.step(sharded.init(model.params), b)
    state = sharded.init(model.params)
    rebuilt = jddp.TrainState(state.step, state.params, state.opt_state, state.model_state, state.rng)
    with pytest.raises(ValueError, match=r"opt_layout` is None.*state\.replace"):
        sharded.step(rebuilt, b)
    with pytest.raises(ValueError, match="shard_optimizer=1"):
        jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh, shard_optimizer=1)  # type: ignore[arg-type]


@pytest.mark.multiprocess
def test_two_processes_of_two_devices(mesh, tmp_path):
    """2 processes x 2 devices: ZeRO-1 equals the replicated engine within 1e-6 there (SGD momentum, AdamW with
    clipping; uneven masks; accumulate_steps 1 and 4), and equals this process's 8-device run. Its checkpoint,
    saved split over 4 devices of 2 processes, restores onto 8 devices of 1 process, split and replicated, and
    continues the 8-device trajectory within 1e-6."""
    multiprocess.run(str(multiprocess.WORKERS / "zero.py"), 2, 2, str(tmp_path), timeout=600)
    reports = [json.loads((tmp_path / f"zero-{rank}.json").read_text()) for rank in range(2)]
    assert reports[0] == reports[1]  # the same decision and values on both processes
    assert set(reports[0]) == {"sgd-momentum-1", "sgd-momentum-4", "adamw-clip-1", "adamw-clip-4", "schedule-free-1"}
    for key, r in reports[0].items():
        assert r["moved"] > 1e-2 and r["params"] < 1e-6 and r["metrics"] < 1e-5, (key, r)
    model = models.odd()
    data = batches(20, n=96, devices=4)  # the worker's batches: its first device's 24 rows all padding
    there = np.load(tmp_path / "params.npz")
    optimizers = {
        "sgd-momentum": (OPTIMIZERS["sgd-momentum"], None),
        "adamw-clip": (OPTIMIZERS["adamw-clip"], 0.5),
        "schedule-free": (lambda: optax.contrib.schedule_free_adamw(3e-3), None),
    }
    engines, runs = {}, {}
    for key in reports[0]:
        name, accumulate = key.rsplit("-", 1)
        make, clip = optimizers[name]
        engines[key] = jddp.DataParallel(
            model.loss_fn, make(), mesh=mesh, accumulate_steps=int(accumulate), clip_grad_norm=clip,
            shard_optimizer=True,
        )  # fmt: skip
        runs[key], _ = train(engines[key], model, data)
        here = models.flat(runs[key].params)
        assert max(float(np.max(np.abs(here[k] - there[f"{key}/{k}"]))) for k in here) < 1e-6, key
    make, clip = optimizers["adamw-clip"]
    whole = runs["adamw-clip-1"]  # the 8-device trajectory the checkpoint continues (its engine: one compilation)
    for shard in (True, False):
        dp = engines["adamw-clip-1"] if shard else jddp.DataParallel(
            model.loss_fn, make(), mesh=mesh, clip_grad_norm=clip, shard_optimizer=False
        )  # fmt: skip
        with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
            restored = ckpt.restore_or_init(dp.init(model.params, rng=0))
        assert int(restored.step) == 10
        resumed, _ = train(dp, model, data[10:], restored)
        assert max_diff(resumed.params, whole.params) < 1e-6, shard


@pytest.mark.parametrize("make", [models.pytree, models.odd], ids=["pytree", "odd"])
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_fused_buffers_train_alike_with_one_collective_each(mesh, make):
    """``fuse_allreduce`` (on by default across CPU processes): one reduce-scatter, one all-reduce (loss, counts,
    metrics and the partial squares of the norm) and one all-gather per step, whatever the number of leaves."""
    model = make()
    data = batches(10)
    runs = {}
    for shard, fuse in ((False, False), (True, True)):
        dp = jddp.DataParallel(model.loss_fn, optax.adamw(1e-2), mesh=mesh, shard_optimizer=shard,
                               fuse_allreduce=fuse, clip_grad_norm=0.5)  # fmt: skip
        runs[shard] = train(dp, model, data)
    assert max_diff(runs[False][0].params, runs[True][0].params) < 1e-6
    assert max_diff(logical_opt_state(runs[False][0]), logical_opt_state(runs[True][0])) < 1e-6
    assert max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(runs[False][1], runs[True][1], strict=True)) < 1e-6
    report = dp.comm_report(runs[True][0], data[0])
    assert [c.op for c in report.collectives] == ["reduce-scatter", "all-reduce", "all-gather"]
    assert all(len(c.operands) == 1 for c in report.collectives)
    split = [lay for lay in zero.leaf_layouts(model.params, N) if lay.axis is not None]
    padded = sum(int(np.prod(lay.stored_shape)) for lay in split)  # the split gradient elements with padding
    assert report.nbytes("all-gather") == 4 * padded and report.nbytes("reduce-scatter") == 4 * padded // N


def test_fused_scatter_and_gather_match_per_leaf_collectives(mesh):
    """Against ``lax.psum_scatter`` and ``lax.all_gather`` leaf by leaf; the large leaf goes alone."""
    from jax import lax

    from jddp.engine import fused

    # (16, 16) float32 is exactly the 1 KiB limit below (packed), (8, 40) over it (alone); one bfloat16 leaf,
    # packed in a buffer of its own dtype.
    shapes = [(16, 3), (5, 8), (24,), (8, 40), (16, 16), (8, 6)]
    dtypes = [np.float32] * 5 + [jnp.bfloat16]
    layouts = [layout.choose(s, N) for s in shapes]
    rng = np.random.default_rng(0)
    per_device = [rng.normal(size=(N, *lay.stored_shape)).astype(d) for lay, d in zip(layouts, dtypes, strict=True)]

    def local(*xs):
        xs = [x[0] for x in xs]
        got = fused.fused_psum_scatter(xs, layouts, "data", N, max_leaf_bytes=1024)
        want = [
            lax.psum_scatter(x, "data", scatter_dimension=lay.axis, tiled=True)
            for x, lay in zip(xs, layouts, strict=True)
        ]
        back = fused.fused_all_gather(got, layouts, "data", N, max_leaf_bytes=1024)
        whole = [
            lax.all_gather(g, "data", axis=lay.axis, tiled=True, to="invarying")
            for g, lay in zip(got, layouts, strict=True)
        ]
        return [g[None] for g in got], [w[None] for w in want], back, whole

    spec, whole_spec = jax.sharding.PartitionSpec("data"), jax.sharding.PartitionSpec()
    program = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(shapes), out_specs=(spec, spec, whole_spec, whole_spec))
    )
    got, want, back, whole = program(*per_device)
    for g, w, b, h, x in zip(got, want, back, whole, per_device, strict=True):
        assert g.dtype == x.dtype and b.dtype == x.dtype
        assert np.array_equal(np.asarray(g), np.asarray(w))
        assert np.array_equal(np.asarray(b), np.asarray(h))
        tolerance = 5e-2 if x.dtype == jnp.bfloat16 else 1e-5
        np.testing.assert_allclose(  # NumPy: the sum over devices, gathered
            np.asarray(b, np.float32), x.astype(np.float32).sum(0), rtol=tolerance, atol=tolerance
        )

    # Alone, the fused functions make one reduce-scatter and one all-gather per dtype, and one of each for the
    # large leaf.
    def fused_only(*xs):
        got = fused.fused_psum_scatter([x[0] for x in xs], layouts, "data", N, max_leaf_bytes=1024)
        return fused.fused_all_gather(got, layouts, "data", N, max_leaf_bytes=1024)

    alone = jax.jit(jax.shard_map(fused_only, mesh=mesh, in_specs=(spec,) * len(shapes), out_specs=whole_spec))
    report = jddp.engine.comm.CommReport.from_hlo(alone.lower(*per_device).compile().as_text())
    assert report.count("reduce-scatter") == 3 and report.count("all-gather") == 3


@pytest.mark.parametrize(
    "name",
    ["adafactor", "lamb", "masked-weight-decay", "multi-steps"],
)
@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_optimizers_that_are_not_elementwise_train_alike(mesh, name):
    """The optimizer sees every leaf in its own shape: factored moments (Adafactor: row and column statistics,
    themselves split), per-leaf norms (LAMB's trust ratio), a decay mask keyed on ``ndim`` and optax's own
    accumulation (MultiSteps' counters replicated, its sums split) give the replicated engine's training."""
    optimizers = {
        "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
        "lamb": lambda: optax.lamb(1e-2),
        "masked-weight-decay": lambda: optax.adamw(1e-2, weight_decay=0.5, mask=lambda p: jax.tree.map(
            lambda x: x.ndim > 1, p)),
        "multi-steps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2).gradient_transformation(),
    }  # fmt: skip
    model = models.odd()
    data = batches(10)
    runs = {}
    for shard in (False, True):
        dp = jddp.DataParallel(model.loss_fn, optimizers[name](), mesh=mesh, shard_optimizer=shard)
        runs[shard] = train(dp, model, data)[0]
    assert max_diff(model.params, runs[False].params) > 1e-2
    assert max_diff(runs[False].params, runs[True].params) < 1e-6
    assert max_diff(logical_opt_state(runs[False]), logical_opt_state(runs[True])) < 1e-6


def test_program_shardings_donation_off_and_a_layout_of_another_length(mesh):
    """The compiled step takes the optimizer state split as laid out and the batch split over "data" (a NumPy
    batch included); ``donate=False`` keeps the old state; a layout that does not describe the state is named."""
    from jddp.checkpoint import digest

    model = models.odd()
    dp = jddp.DataParallel(model.loss_fn, optax.adam(1e-3), mesh=mesh, shard_optimizer=True, donate=False)
    state = dp.init(model.params)
    b = models.batch(64)
    compiled = dp._program(state).lower(*dp._args(state, b)).compile()
    (train_in, _, batch_in), _ = compiled.input_shardings
    opt_in = jax.tree.leaves(train_in[2])
    assert [s.spec for s in opt_in] == [lay.spec() for lay in state.opt_layout]
    assert all(s.spec == jax.sharding.PartitionSpec("data") for s in jax.tree.leaves(batch_in))
    new, _ = dp.step(state, b)
    assert not state.opt_state[0].mu["w1"].is_deleted() and float(jnp.abs(state.opt_state[0].mu["w1"]).sum()) == 0
    assert float(jnp.abs(new.opt_state[0].mu["w1"]).sum()) > 0
    with pytest.raises(ValueError, match=r"opt_layout` describes 10 leaves, but `state.opt_state` has 11"):
        digest.leaf_layouts(state.replace(opt_layout=state.opt_layout[:-1]))
