"""Replicas checked while training: a one-ulp change in one device's copy of one leaf is found and named (leaf,
device, process), by ``dp.check_replicas`` and inside ``fit``, which then stops without saving the bad state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp.engine.replicas import ReplicaMismatchError
from tests import models

N = 8


def with_one_copy_nudged(leaf: jax.Array, device_position: int, element: int = 0) -> jax.Array:
    """``leaf`` (replicated) with one element of one device's copy moved by one ulp."""
    parts = []
    for shard in leaf.addressable_shards:
        data = np.array(shard.data)
        if shard.device == leaf.sharding.mesh.devices.flat[device_position]:
            flat = data.reshape(-1)
            flat[element] = np.nextafter(flat[element], np.inf, dtype=flat.dtype)
        parts.append(jax.device_put(data, shard.device))
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, parts)


def setup():
    model = models.nnx_model()
    dp = jddp.DataParallel(model.loss_fn, optax.adam(1e-2), mesh=jddp.data_mesh())
    state = dp.init(model.params, model.model_state)
    state, _ = dp.step(state, models.batch(64, 0))
    return dp, state


@pytest.mark.parametrize("position", [0, 5, 7])
def test_a_one_ulp_change_in_one_replica_is_named(position):
    dp, state = setup()
    dp.check_replicas(state)  # identical after a step
    params = dict(state.params)
    kernel = params["l2"]["kernel"]
    bad = jax.tree.map(lambda x: x, state.params)
    bad["l2"]["kernel"] = with_one_copy_nudged(kernel, position, element=7)
    state = jddp.TrainState(state.step, bad, state.opt_state, state.model_state, state.rng)
    device = dp.mesh.devices.flat[position]
    with pytest.raises(
        ReplicaMismatchError,
        match=rf"Replicas differ at state\.params\['l2'\]\['kernel'\]: device {device.id} \(process 0\) differ "
        rf"from the other 7 of 8 replicas",
    ):
        dp.check_replicas(state)


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_every_kind_of_leaf_is_checked():
    """Optimizer state, model state, the step counter and the rng key too."""
    dp, state = setup()
    for name in ("opt_state", "model_state", "step", "rng"):
        tree = getattr(state, name)
        leaves, treedef = jax.tree.flatten(tree)
        leaves[-1] = with_one_copy_nudged(leaves[-1], 3) if leaves[-1].dtype.kind == "f" else _flip(leaves[-1], 3)
        fields = {k: getattr(state, k) for k in ("step", "params", "opt_state", "model_state", "rng")}
        broken = jddp.TrainState(**{**fields, name: treedef.unflatten(leaves)})
        with pytest.raises(ReplicaMismatchError, match=rf"Replicas differ at state\.{name}"):
            dp.check_replicas(broken)


def _flip(leaf: jax.Array, device_position: int) -> jax.Array:
    parts = []
    for shard in leaf.addressable_shards:
        data = np.array(shard.data)
        if shard.device == leaf.sharding.mesh.devices.flat[device_position]:
            data.reshape(-1)[0] ^= 1
        parts.append(jax.device_put(data, shard.device))
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, parts)


def test_fit_stops_at_the_next_check_and_keeps_the_last_good_checkpoint(tmp_path):
    """A replica goes wrong after step 6 (inside dp.step, as a fault would). fit checks every 5 steps and before
    each checkpoint (every 4): it finds it before saving step 8, raises naming it, and the good checkpoint of step
    4 stays the last."""

    def loss_fn(params, model_state, batch, rng):
        return jnp.mean((batch["x"] @ params["w"]) ** 2), (model_state, {})

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.01), mesh=jddp.data_mesh())
    step = dp.step

    def faulty(state, batch):
        state, metrics = step(state, batch)
        if int(state.step) == 6:
            params = {"w": with_one_copy_nudged(state.params["w"], 2)}
            state = jddp.TrainState(state.step, params, state.opt_state, state.model_state, state.rng)
        return state, metrics

    dp.step = faulty  # type: ignore[method-assign]
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    data = jddp.data.DataLoader({"x": x}, global_batch_size=8, mesh=dp.mesh)
    ckpt = jddp.Checkpointer(tmp_path / "ckpt", save_every=4)
    with pytest.raises(ReplicaMismatchError, match=r"state\.params\['w'\]: device \d+ \(process 0\)"):
        jddp.fit(dp, dp.init({"w": np.ones(3, np.float32)}), data, steps=20, checkpointer=ckpt,
                 replica_check_every=5, progress=False)  # fmt: skip
    ckpt.close()
    assert jddp.Checkpointer(tmp_path / "ckpt", read_only=True).all_steps() == [4]


def test_fit_refuses_a_bad_replica_check_every():
    dp = jddp.DataParallel(lambda p, s, b, r: (p["w"].sum(), (s, {})), optax.sgd(0.1), mesh=jddp.data_mesh())
    data = jddp.data.DataLoader({"x": np.zeros((16, 3), np.float32)}, global_batch_size=8, mesh=dp.mesh)
    with pytest.raises((ValueError, TypeError), match="replica_check_every"):
        jddp.fit(dp, dp.init({"w": np.ones(3, np.float32)}), data, steps=2, replica_check_every=0, progress=False)
