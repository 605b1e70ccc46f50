"""An adversarial catalogue of ordinary mistakes at jddp's boundary: each one a clear error, nothing changed.

Every case asserts the exception type and a message that names the value (``pytest.raises(match=...)``),
that the training state still steps afterwards, and that no file on disk changed (a directory holding a
published checkpoint, and the case's own temporary directory). Cases are grouped by layer: engine, data,
checkpoint, runtime, launcher, config.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jddp
from jddp import config as config_lib
from jddp.cli import launch
from tests import models

N = 64  # global batch of the good batch


@dataclasses.dataclass
class Env:
    dp: jddp.DataParallel
    state: jddp.TrainState
    model: models.Model
    disk: Path  # a directory with a published checkpoint (step 0) and a data file
    tmp: Path  # this case's own directory
    writer: Any = None  # a Checkpointer the case's setup opened

    def batch(self, **changes):
        return {**models.batch(N), **changes}


@dataclasses.dataclass
class Case:
    id: str
    call: Callable[[Env], Any]
    error: type[BaseException]
    match: str
    setup: Callable[[Env], Any] | None = None
    starts_processes: bool = False  # Grain worker processes: the full tier only (conftest.py)


class NamedBatch(typing.NamedTuple):
    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    lr: float = 0.1
    epochs: int = 3
    name: str = "run"


def other_mesh_state(env: Env):
    dp = jddp.DataParallel(env.model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(jax.devices()[:4]))
    return dp.init(env.model.params)


def donated(env: Env):
    old = env.dp.init(env.model.params)
    env.dp.step(old, env.batch())
    return old


def loss_returning(value):
    def loss_fn(params, model_state, batch, rng):
        return value(params, batch)

    return loss_fn


def step_with(env: Env, loss_fn, **kwargs):
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), **kwargs)
    return dp.step(dp.init(env.model.params), env.batch())


def loader(source=None, **kwargs):
    source = {"x": np.zeros((64, 3), np.float32), "y": np.zeros(64, np.int32)} if source is None else source
    kwargs.setdefault("global_batch_size", 16)
    return jddp.data.DataLoader(source, **kwargs)


class ShortSource:
    """Says it has 64 examples and holds 40: the kind of off-by-some a hand-written source has."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 40:
            raise IndexError(f"record {i} out of range")
        return {"x": np.full(3, i, np.float32)}


def failing_transform(example, rng):
    return {"x": example["image"]}  # the field is called "x"


def failing_batch_transform(batch, rng):
    return {"x": batch["x"].reshape(-1, 5)}


def first_batch(**kwargs):
    return next(iter(loader(**kwargs)))


def drop_last_eval(env: Env):
    data = {"x": np.zeros((100, models.IN), np.float32), "y": np.zeros(100, np.int32)}
    return env.dp.evaluate(env.state, jddp.data.DataLoader(data, global_batch_size=16, drop_last=True))


def ckpt(env: Env, **kwargs):
    kwargs.setdefault("directory", env.tmp / "ckpt")
    with jddp.Checkpointer(**kwargs) as c:
        return c


def other_model(env: Env):
    params = {**env.model.params, "w1": np.zeros((models.IN, 3), np.float32)}
    dp = jddp.DataParallel(env.model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
    with jddp.Checkpointer(env.disk, read_only=True) as c:
        c.restore_or_init(dp.init(params))


def other_config(env: Env):
    with jddp.Checkpointer(env.disk, read_only=True, config={"lr": 0.5}) as c:
        c.restore_or_init(env.state)


def open_writer(env: Env):
    env.writer = jddp.Checkpointer(env.tmp / "ckpt")


def closed_writer(env: Env):
    open_writer(env)
    env.writer.close()


def a_file(env: Env):
    (env.tmp / "file").write_text("x")


def launch_config(*argv: str):
    parser = launch.get_args_parser()
    parser.exit_on_error = False  # a value the option's type refuses: argparse's ArgumentError, not exit 2
    return launch.config_from_args(parser.parse_args(list(argv)))


def with_env(name: str, value: str, call: Callable[[], Any]):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return call()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def yaml_file(env: Env, text: str) -> str:
    path = env.tmp / "config.yaml"
    path.write_text(text)
    return str(path)


MASK = (np.arange(N) % 2).astype(np.float32)

CASES = [
    # ------------------------------------------------------------ engine: DataParallel(...)
    Case(
        "loss_fn not callable",
        lambda e: jddp.DataParallel(3, optax.sgd(0.1), mesh=jddp.data_mesh()),
        TypeError,
        r"`loss_fn` must be callable, got int",
    ),
    Case(
        "optimizer factory not called",
        lambda e: jddp.DataParallel(e.model.loss_fn, optax.adam, mesh=jddp.data_mesh()),
        TypeError,
        r"`optimizer` must be an optax.GradientTransformation, got function",
    ),
    Case(
        "mesh without a data axis",
        lambda e: jddp.DataParallel(e.model.loss_fn, optax.sgd(0.1), mesh=jax.make_mesh((8,), ("batch",))),
        ValueError,
        r"`mesh` must be a jax.sharding.Mesh with an axis named 'data'",
    ),
    Case(
        "mesh not a mesh",
        lambda e: jddp.DataParallel(e.model.loss_fn, optax.sgd(0.1), mesh="data"),
        ValueError,
        r"axis named 'data', got 'data'",
    ),
    Case(
        "accumulate_steps 0",
        lambda e: step_with(e, e.model.loss_fn, accumulate_steps=0),
        ValueError,
        r"`accumulate_steps` must be an int >= 1, got accumulate_steps=0",
    ),
    Case(
        "accumulate_steps float",
        lambda e: step_with(e, e.model.loss_fn, accumulate_steps=2.0),
        ValueError,
        r"`accumulate_steps` must be an int >= 1, got accumulate_steps=2.0",
    ),
    Case(
        "accumulate_steps bool",
        lambda e: step_with(e, e.model.loss_fn, accumulate_steps=True),
        ValueError,
        r"`accumulate_steps` must be an int >= 1, got accumulate_steps=True",
    ),
    Case(
        "reduce_dtype int8",
        lambda e: step_with(e, e.model.loss_fn, reduce_dtype=jnp.int8),
        ValueError,
        r"`reduce_dtype` must be a float dtype .* got reduce_dtype=<class 'jax.numpy.int8'>",
    ),
    Case(
        "clip_grad_norm negative",
        lambda e: step_with(e, e.model.loss_fn, clip_grad_norm=-1.0),
        ValueError,
        r"`clip_grad_norm` must be a positive number or None, got clip_grad_norm=-1.0",
    ),
    Case(
        "clip_grad_norm nan",
        lambda e: step_with(e, e.model.loss_fn, clip_grad_norm=float("nan")),
        ValueError,
        r"got clip_grad_norm=nan",
    ),
    Case(
        "nonfinite typo",
        lambda e: step_with(e, e.model.loss_fn, nonfinite="skipp"),
        ValueError,
        r"`nonfinite` must be 'skip', 'raise' or 'ignore', got nonfinite='skipp'",
    ),
    Case(
        "max_inflight 0",
        lambda e: step_with(e, e.model.loss_fn, max_inflight=0),
        ValueError,
        r"`max_inflight` must be an int >= 1, got max_inflight=0",
    ),
    Case(
        "fuse_allreduce string",
        lambda e: step_with(e, e.model.loss_fn, fuse_allreduce="yes"),
        ValueError,
        r"got fuse_allreduce='yes'",
    ),
    # ------------------------------------------------------------ engine: init
    Case(
        "params with a string leaf",
        lambda e: e.dp.init({**e.model.params, "name": "mlp"}),
        TypeError,
        r"params\['name'\] is str \('mlp'\)",
    ),
    Case(
        "params with an integer leaf",
        lambda e: e.dp.init({**e.model.params, "counts": np.zeros(3, np.int32)}),
        TypeError,
        r"params\['counts'\] has dtype int32, but parameters are trained by gradients",
    ),
    Case(
        "params with a bool leaf",
        lambda e: e.dp.init({**e.model.params, "keep": np.ones(3, bool)}),
        TypeError,
        r"params\['keep'\] has dtype bool.*move integer state .* to `model_state`",
    ),
    Case(
        "model_state with None inside a list",
        lambda e: e.dp.init(e.model.params, model_state={"stats": [np.float32(1.0), "x"]}),
        TypeError,
        r"model_state\['stats'\]\[1\] is str",
    ),
    Case(
        "rng a string",
        lambda e: e.dp.init(e.model.params, rng="0"),
        TypeError,
        r"`rng` must be a JAX PRNG key or an int seed, got str",
    ),
    Case(
        "rng of another impl",
        lambda e: e.dp.init(e.model.params, rng=jax.random.key(0, impl="rbg")),
        ValueError,
        r"`rng` must be a threefry key \(uint32\[2\] key data\), got dtype=uint32, shape=\(4,\)",
    ),
    # ------------------------------------------------------------ engine: step
    Case(
        "state a dict",
        lambda e: e.dp.step(dataclasses.asdict(e.state), e.batch()),
        TypeError,
        r"`state` must be a jddp.TrainState from `init`, got dict",
    ),
    Case(
        "state of another mesh",
        lambda e: e.dp.step(other_mesh_state(e), e.batch()),
        ValueError,
        r"`state` lives on another mesh",
    ),
    Case(
        "state donated already",
        lambda e: e.dp.step(donated(e), e.batch()),
        ValueError,
        r"`state` was donated to an earlier step.*donate=False",
    ),
    Case(
        "eval_step on a donated state",
        lambda e: e.dp.eval_step(donated(e), e.batch()),
        ValueError,
        r"`state` was donated to an earlier step",
    ),
    Case(
        "batch not divisible by devices",
        lambda e: e.dp.step(e.state, models.batch(60)),
        ValueError,
        r"global_batch_size=60, devices=8, accumulate_steps=1\. Use a global batch size that is a multiple of 8",
    ),
    Case(
        "batch leaves of different sizes",
        lambda e: e.dp.step(e.state, e.batch(y=np.zeros(32, np.int32))),
        ValueError,
        r"same leading \(batch\) size, got \['x'\]: 64, \['y'\]: 32",
    ),
    Case(
        "batch with a scalar leaf",
        lambda e: e.dp.step(e.state, e.batch(lr=np.float32(0.1))),
        ValueError,
        r"\['lr'\]: scalar",
    ),
    Case("batch empty dict", lambda e: e.dp.step(e.state, {}), ValueError, r"`batch` has no array leaves"),
    Case(
        "batch with a string leaf",
        lambda e: e.dp.step(e.state, e.batch(name=np.array(["a"] * N))),
        TypeError,
        r"batch\['name'\] has dtype <U1: only numbers and bools",
    ),
    Case(
        "batch with an object leaf",
        lambda e: e.dp.step(e.state, e.batch(meta=np.array([None] * N))),
        TypeError,
        r"batch\['meta'\] has dtype object",
    ),
    Case(
        "mask of shape [B, 1]",
        lambda e: e.dp.step(e.state, e.batch(mask=MASK[:, None])),
        ValueError,
        r"mask must mark each example .* shape \[64\], got shape \(64, 1\)",
    ),
    Case(
        "mask per token",
        lambda e: e.dp.step(e.state, e.batch(mask=np.ones((N, 5), np.float32))),
        ValueError,
        r"got shape \(64, 5\).*'token_mask'",
    ),
    Case(
        "mask of -1",
        lambda e: e.dp.step(e.state, e.batch(mask=MASK - 1)),
        ValueError,
        r"mask must be 0 \(padding\) or 1 \(real example\), got -1.0",
    ),
    Case(
        "mask NaN",
        lambda e: e.dp.step(e.state, e.batch(mask=np.where(MASK > 0, 1, np.nan).astype(np.float32))),
        ValueError,
        r"got nan among its values",
    ),
    Case(
        "mask of weights",
        lambda e: e.dp.step(e.state, e.batch(mask=MASK * 2)),
        ValueError,
        r"got 2.0 among its values.*jddp.Weighted",
    ),
    Case(
        "mask as a device array of 3s",
        lambda e: e.dp.step(e.state, e.batch(mask=jnp.full(N, 3.0))),
        ValueError,
        r"got 3.0 among its values",
    ),
    Case(
        "mask in a NamedTuple, wrong shape",
        lambda e: e.dp.step(e.state, NamedBatch(e.batch()["x"], e.batch()["y"], MASK[:32])),
        ValueError,
        r"same leading \(batch\) size",
    ),
    Case(
        "mask in a NamedTuple, value 5",
        lambda e: e.dp.step(e.state, NamedBatch(e.batch()["x"], e.batch()["y"], MASK * 5)),
        ValueError,
        r"got 5.0 among its values",
    ),
    Case(
        "mask of strings",
        lambda e: e.dp.step(e.state, e.batch(mask=np.array(["1"] * N))),
        TypeError,
        r"batch\['mask'\] has dtype <U1",
    ),
    Case(
        "mask complex",
        lambda e: e.dp.step(e.state, e.batch(mask=MASK.astype(np.complex64))),
        TypeError,
        r"mask must be a real or bool array of 0/1, got dtype complex64",
    ),
    Case(
        "loss_fn returns (loss, metrics), the Flax habit",
        lambda e: step_with(e, lambda p, ms, b, r: (jnp.sum(p["w1"]), {"acc": jnp.float32(1)})),
        TypeError,
        r"It returned a tuple of 2 \(.*, dict\) \(the metrics alone as its second element: return \(loss, "
        r"\(model_state, metrics\)\)",
    ),
    Case(
        "loss_fn returns a bare loss",
        lambda e: step_with(e, loss_returning(lambda p, b: jnp.sum(p["w1"]))),
        TypeError,
        r"`loss_fn` must return `\(loss, \(new_model_state, metrics\)\)`.*It returned ArrayImpl|It returned",
    ),
    Case(
        "loss_fn returns a per-example loss",
        lambda e: step_with(e, loss_returning(lambda p, b: (b["x"][:, 0], ({}, {})))),
        ValueError,
        r"The loss returned by `loss_fn` must be a scalar .* shape=\(8,\)",
    ),
    Case(
        "loss_fn metrics a list",
        lambda e: step_with(e, loss_returning(lambda p, b: (jnp.sum(p["w1"]), ({}, [1.0])))),
        TypeError,
        r"metrics of type list",
    ),
    Case(
        "loss_fn metric named loss",
        lambda e: step_with(e, loss_returning(lambda p, b: (jnp.sum(p["w1"]), ({}, {"loss": 1.0})))),
        ValueError,
        r"Metric names \['loss'\] are reserved by jddp",
    ),
    Case(
        "loss_fn with a shape mismatch",
        lambda e: step_with(e, loss_returning(lambda p, b: (jnp.sum(b["x"] @ p["b1"]), ({}, {})))),
        TypeError,  # JAX's own error, with a note naming the function and the per-device shapes it saw
        r"dot_general requires contracting dimensions(.|\n)*jddp: raised while tracing .*loss_fn \(.*test_bad_inputs"
        r"\.py:\d+\) in DataParallel.step.*\['x'\]: float32\[8, 12\], \['y'\]: int32\[8\]: the global batch of 64 "
        r"split over 8 device\(s\)\), with params \['b1'\]: float32\[",
    ),
    Case(
        "loss_fn with Python if on an array, accumulating",
        lambda e: step_with(
            e,
            loss_returning(lambda p, b: (jnp.sum(p["w1"]) if b["x"].sum() > 0 else 0.0, ({}, {}))),
            accumulate_steps=2,
        ),
        jax.errors.TracerBoolConversionError,
        r"jddp: raised while tracing(.|\n)*float32\[4, 12\](.|\n)*8 device\(s\) and 2 accumulation steps(.|\n)*"
        r"Python `if`",
    ),
    Case(
        "eval_fn with a shape mismatch",
        lambda e: jddp.DataParallel(
            e.model.loss_fn,
            optax.sgd(0.1),
            mesh=jddp.data_mesh(),
            eval_fn=lambda p, s, b: {"loss": jnp.mean(b["x"][:, :3] @ p["w1"])},
        ).eval_step(e.state, e.batch()),
        TypeError,
        r"jddp: raised while tracing .*<lambda> .* in DataParallel.eval_step.*float32\[8, 12\]",
    ),
    Case(
        "evaluate over a drop_last loader",
        drop_last_eval,
        ValueError,
        r"`evaluate` over a DataLoader with drop_last=True would skip the last 4 of 100 examples",
    ),
    # ------------------------------------------------------------ data: DataLoader(...)
    Case(
        "global batch not divisible by devices",
        lambda e: loader(global_batch_size=12),
        ValueError,
        r"global_batch_size=12, processes=1, devices=8\. Use a multiple of 8",
    ),
    Case("global batch 0", lambda e: loader(global_batch_size=0), ValueError, r"global_batch_size"),
    Case(
        "global batch float",
        lambda e: loader(global_batch_size=16.0),
        ValueError,
        r"`global_batch_size` must be an int >= 1, got global_batch_size=16.0",
    ),
    Case(
        "source empty",
        lambda e: loader({"x": np.zeros((0, 3), np.float32)}),
        ValueError,
        r"The source is empty \(len\(source\)=0\)",
    ),
    Case(
        "source lengths differ",
        lambda e: loader({"x": np.zeros((64, 3)), "y": np.zeros(60)}),
        ValueError,
        r"same length, got \{'x': 64, 'y': 60\}",
    ),
    Case(
        "source not indexable",
        lambda e: loader(5),
        TypeError,
        r"The source must support `len\(\)` and indexing .* got int",
    ),
    Case(
        "a tuple of columns (PyTorch's TensorDataset(X, Y))",
        lambda e: loader((np.zeros((64, 3), np.float32), np.zeros(64, np.int32))),
        TypeError,
        r"The source is a tuple of 2 arrays of 64 rows each, which would be read as 2 examples.*\{'x': X, 'y': Y\}",
    ),
    Case(
        "records that are (features, label) tuples",
        lambda e: next(iter(loader([(np.zeros(3, np.float32), 1)] * 64))),
        TypeError,
        r"Example \d+ of the source is a tuple of 2 \(PyTorch's `\(features, label\)`\).*\{'x': features, 'y': label\}",
    ),
    Case(
        "source field of strings",
        lambda e: loader({"x": np.zeros((64, 3), np.float32), "label": np.array(["cat"] * 64)}),
        TypeError,
        r"DataLoader field 'label' of the source has dtype <U3 \(strings\)",
    ),
    Case(
        "source field of objects",
        lambda e: loader({"x": np.zeros((64, 3), np.float32), "meta": np.array([{}] * 64)}),
        TypeError,
        r"DataLoader field 'meta' of the source has dtype object \(Python objects\)",
    ),
    Case(
        "records with a string field",
        lambda e: loader([{"x": np.float32(1), "name": "a"}] * 64),
        TypeError,
        r"DataLoader field 'name' of the source has dtype <U1",
    ),
    Case(
        "source field of datetimes",
        lambda e: loader({"x": np.zeros(64, np.float32), "t": np.zeros(64, "datetime64[s]")}),
        TypeError,
        r"field 't' .* \(datetimes\)",
    ),
    Case(
        "source mask of shape [N, 1]",
        lambda e: loader({"x": np.zeros((64, 3), np.float32), "mask": np.ones((64, 1))}),
        ValueError,
        r"The 'mask' field of the source must be 0/1 per example \(shape \[N\]\), got shape \(64, 1\)",
    ),
    Case(
        "source mask of 2s",
        lambda e: loader({"x": np.zeros((64, 3), np.float32), "mask": np.full(64, 2.0)}),
        ValueError,
        r"The 'mask' field of the source must be 0 or 1, got 2.0",
    ),
    Case(
        "source raises while read",
        lambda e: first_batch(source=ShortSource(), seed=0),
        IndexError,  # the source's own error, with a note saying what the loader was reading
        r"record \d+ out of range(.|\n)*jddp.DataLoader: raised reading examples \[\d+, .*\] of the source of "
        r"len 64 \(epoch 0, loader position 0, process rank 0\)",
    ),
    Case(
        "source raises in a worker process",
        lambda e: first_batch(source=ShortSource(), seed=0, worker_count=1),
        IndexError,
        r"record \d+ out of range(.|\n)*jddp.DataLoader: raised reading examples",
        starts_processes=True,
    ),
    Case(
        "transform raises",
        lambda e: first_batch(transform=failing_transform),
        KeyError,
        r"'image'(.|\n)*jddp.DataLoader: raised in `transform`, on example \d+ of the source \(epoch 0, "
        r"loader position 0",
    ),
    Case(
        "batch_transform raises",
        lambda e: first_batch(batch_transform=failing_batch_transform),
        ValueError,
        r"cannot reshape(.|\n)*jddp.DataLoader: raised in `batch_transform`, on examples \[\d+, .*, \.\.\.\] "
        r"\(epoch 0",
    ),
    Case(
        "worker_count -1",
        lambda e: loader(worker_count=-1),
        ValueError,
        r"`worker_count` must be an int >= 0, got worker_count=-1",
    ),
    Case(
        "prefetch float",
        lambda e: loader(prefetch=1.5),
        ValueError,
        r"`prefetch` must be an int >= 0, got prefetch=1.5",
    ),
    Case("seed negative", lambda e: loader(seed=-1), ValueError, r"seed"),
    Case("seed a string", lambda e: loader(seed="0"), ValueError, r"`seed` must be an int >= 0, got seed='0'"),
    Case(
        "shuffle a string",
        lambda e: loader(shuffle="no"),
        TypeError,
        r"`shuffle` must be True or False, got shuffle='no'",
    ),
    Case(
        "drop_last None",
        lambda e: loader(drop_last=None),
        TypeError,
        r"`drop_last` must be True or False, got drop_last=None",
    ),
    Case(
        "dataset smaller than a batch with drop_last",
        lambda e: loader({"x": np.zeros((8, 3), np.float32)}),
        ValueError,
        r"smaller than one global batch with `drop_last=True`: dataset_size=8, global_batch_size=16",
    ),
    Case(
        "mesh a list of devices",
        lambda e: loader(mesh=jax.devices()),
        TypeError,
        r"`mesh` must be a jax.sharding.Mesh with an axis named 'data'",
    ),
    Case(
        "set_state of another batch size",
        lambda e: loader().set_state({**loader(global_batch_size=32).get_state()}),
        ValueError,
        r"global_batch_size",
    ),
    Case("set_state garbage", lambda e: loader().set_state({"position": "x"}), ValueError, r"position|state"),
    Case("set_epoch negative", lambda e: loader().set_epoch(-1), ValueError, r"epoch"),
    Case(
        "sampler rank out of range",
        lambda e: jddp.data.DistributedBatchSampler(64, global_batch_size=16, num_replicas=2, rank=2),
        ValueError,
        r"`rank` must be in \[0, num_replicas\), got rank=2, num_replicas=2",
    ),
    Case(
        "sampler batch not divisible by replicas",
        lambda e: jddp.data.DistributedBatchSampler(64, global_batch_size=15, num_replicas=2),
        ValueError,
        r"global_batch_size=15, num_replicas=2; use a multiple of 2",
    ),
    # ------------------------------------------------------------ checkpoint
    Case(
        "save_every 0",
        lambda e: ckpt(e, save_every=0),
        ValueError,
        r"`save_every` must be an int >= 1 or None, got save_every=0",
    ),
    Case(
        "max_to_keep 0",
        lambda e: ckpt(e, max_to_keep=0),
        ValueError,
        r"`max_to_keep` must be an int >= 1 or None, got max_to_keep=0",
    ),
    Case(
        "preemption_check_s negative",
        lambda e: ckpt(e, preemption_check_s=-1),
        ValueError,
        r"`preemption_check_s` must be a finite number >= 0, got preemption_check_s=-1",
    ),
    Case(
        "lease_timeout_s 0",
        lambda e: ckpt(e, lease_timeout_s=0),
        ValueError,
        r"`lease_timeout_s` must be a finite number >= 1, got lease_timeout_s=0",
    ),
    Case(
        "read_only with save_every",
        lambda e: ckpt(e, read_only=True, save_every=10),
        ValueError,
        r"A read-only Checkpointer never saves, got save_every=10",
    ),
    Case(
        "read_only a string",
        lambda e: ckpt(e, read_only="true"),
        TypeError,
        r"`read_only` must be True or False, got read_only='true'",
    ),
    Case(
        "directory an int",
        lambda e: ckpt(e, directory=7),
        TypeError,
        r"`directory` must be a path \(str or os.PathLike\), got int: 7",
    ),
    Case("directory empty", lambda e: ckpt(e, directory=""), ValueError, r"`directory` is empty"),
    Case(
        "directory is a file",
        lambda e: ckpt(e, directory=e.tmp / "file"),
        NotADirectoryError,
        r"Checkpoint directory '.*/file' is a file",
        a_file,
    ),
    Case(
        "directory inside a file",
        lambda e: ckpt(e, directory=e.tmp / "file" / "ckpt"),
        NotADirectoryError,
        r"is inside '.*/file', which is a file",
        a_file,
    ),
    Case(
        "directory not writable",
        lambda e: ckpt(e, directory="/proc/jddp-ckpt"),
        PermissionError,
        r"Checkpoint directory '/proc/jddp-ckpt' is not writable by process 0",
    ),
    Case(
        "a second writer",
        lambda e: jddp.Checkpointer(e.tmp / "ckpt"),
        jddp.CheckpointLeaseError,
        r"is being written by another run: pid \d+ on",
        open_writer,
    ),
    Case(
        "save a dict",
        lambda e: e.writer.save({"params": "w"}),
        TypeError,
        r"`state` of Checkpointer.save holds no arrays, got dict",
        open_writer,
    ),
    Case(
        "save a state of one's own without its step",
        lambda e: e.writer.save({"params": np.ones(3, np.float32)}),
        TypeError,
        r"Checkpointer.save needs the step of a dict state: pass `step=`",
        open_writer,
    ),
    Case(
        "save a TrainState with a step of one's own",
        lambda e: e.writer.save(e.state, step=3),
        TypeError,
        r"`step` is for a state of your own .* drop step=3",
        open_writer,
    ),
    Case(
        "save with a loader that is not one",
        lambda e: e.writer.save(e.state, loader=[1, 2]),
        TypeError,
        r"`loader` must be a jddp.data.DataLoader .* got list",
        open_writer,
    ),
    Case(
        "restore into a dict",
        lambda e: jddp.Checkpointer(e.disk, read_only=True).restore_or_init({"a": "w"}),
        TypeError,
        r"`state` of Checkpointer.restore_or_init holds no arrays, got dict",
    ),
    Case(
        "restore with a loader that is not one",
        lambda e: jddp.Checkpointer(e.disk, read_only=True).restore_or_init(e.state, "loader"),
        TypeError,
        r"`loader` must be a jddp.data.DataLoader .* got str",
    ),
    Case(
        "restore another model",
        other_model,
        ValueError,
        r"holds another model: its leaf \['params'\]\['w1'\] has shape \(12, 16\)",
    ),
    Case("restore another config", other_config, ValueError, r"was saved with another config"),
    Case(
        "save after close",
        lambda e: e.writer.save(e.state),
        jddp.CheckpointError,
        r"Cannot save: this Checkpointer of '.*ckpt' is closed",
        closed_writer,
    ),
    Case(
        "restore after close",
        lambda e: e.writer.restore_or_init(e.state),
        jddp.CheckpointError,
        r"Cannot restore: this Checkpointer of '.*ckpt' is closed",
        closed_writer,
    ),
    Case(
        "maybe_save after close",
        lambda e: e.writer.maybe_save(e.state),
        jddp.CheckpointError,
        r"Cannot save: this Checkpointer of '.*ckpt' is closed",
        closed_writer,
    ),
    Case(
        "save on a reader",
        lambda e: jddp.Checkpointer(e.disk, read_only=True).save(e.state),
        jddp.CheckpointError,
        r"is read-only \(read_only=True\): it never saves",
    ),
    # ------------------------------------------------------------ runtime
    Case("data_mesh of no devices", lambda e: jddp.data_mesh([]), ValueError, r"`devices` is empty"),
    Case(
        "started as one of a group, not joined",
        lambda e: with_env("JDDP_NUM_PROCESSES", "2", jddp.data_mesh),
        RuntimeError,
        r"started as process .* of a group of 2 \(JDDP_NUM_PROCESSES=2.*jddp.initialize\(\) was not called",
    ),
    Case(
        "not joined, then a DataParallel",
        lambda e: with_env(
            "JDDP_NUM_PROCESSES", "4", lambda: jddp.DataParallel(e.model.loss_fn, optax.sgd(0.1), mesh=e.dp.mesh)
        ),
        RuntimeError,
        r"JDDP_NUM_PROCESSES=4",
    ),
    Case(
        "not joined, then a Checkpointer",
        lambda e: with_env("JDDP_NUM_PROCESSES", "2", lambda: jddp.Checkpointer(e.tmp / "c")),
        RuntimeError,
        r"JDDP_NUM_PROCESSES=2",
    ),
    Case("simulate devices after the backend started", lambda e: jddp.simulate_cpu_devices(4), RuntimeError, r"4"),
    Case(
        "barrier name with a slash",
        lambda e: jddp.barrier("a/b"),
        ValueError,
        r"barrier name='a/b' must be a non-empty string without '/'",
    ),
    # ------------------------------------------------------------ launcher (no JAX in its process)
    Case(
        "launch -n 0",
        lambda e: launch_config("-n", "0", __file__),
        argparse.ArgumentError,
        r"argument -n/--nprocs/--nproc-per-node: must be auto, device, host or an integer of at least 1, got '0'",
    ),
    Case(
        "launch --devices-per-process 0",
        lambda e: launch_config("--devices-per-process", "0", __file__),
        argparse.ArgumentError,
        r"argument --devices-per-process: must be an integer of at least 1, got '0'",
    ),
    Case(
        "launch --max-restarts -1",
        lambda e: launch_config("--max-restarts", "-1", __file__),
        argparse.ArgumentError,
        r"argument --max-restarts: must be an integer of 0 or more, got '-1'",
    ),
    Case(
        "launch --nnodes 2 without a coordinator",
        lambda e: launch_config("--nnodes", "2", __file__),
        ValueError,
        r"--nnodes > 1 needs --coordinator HOST:PORT",
    ),
    Case(
        "launch --node-rank out of range",
        lambda e: launch_config("--nnodes", "2", "--node-rank", "2", "--coordinator", "127.0.0.1:5000", __file__),
        ValueError,
        r"--node-rank=2 must be in \[0, --nnodes=2\)",
    ),
    Case(
        "launch --coordinator without a port",
        lambda e: launch_config("--coordinator", "127.0.0.1", __file__),
        ValueError,
        r"--coordinator.*127.0.0.1",
    ),
    Case(
        "launch --kill-grace 0",
        lambda e: launch_config("--kill-grace", "0", __file__),
        argparse.ArgumentError,
        r"argument --kill-grace: must be positive and finite: a number of seconds, got '0'",
    ),
    Case(
        "launch --peer-timeout -5",
        lambda e: launch_config("--peer-timeout", "-5", __file__),
        argparse.ArgumentError,
        r"argument --peer-timeout: must be positive and finite: a number of seconds, got '-5'",
    ),
    *(
        Case(
            f"launch --init-timeout {value}",
            lambda e, value=value: launch_config("--init-timeout", value, __file__),
            argparse.ArgumentError,
            rf"argument --init-timeout: must be .*a number of seconds.*got '{value}'",
        )
        for value in ("-5", "0", "inf", "nan", "abc")
    ),
    Case(
        "launch a missing script", lambda e: launch_config("trian.py"), ValueError, r"script 'trian.py' does not exist"
    ),
    # ------------------------------------------------------------ config
    Case(
        "config unknown key",
        lambda e: config_lib.parse(TrainConfig, ["lrr=0.5"]),
        config_lib.ConfigError,
        r"Unknown config key `lrr`.*lr",
    ),
    Case(
        "config bad value", lambda e: config_lib.parse(TrainConfig, ["epochs=three"]), config_lib.ConfigError, r"epochs"
    ),
    Case(
        "config override without =",
        lambda e: config_lib.parse(TrainConfig, ["epochs"]),
        config_lib.ConfigError,
        r"epochs",
    ),
    Case(
        "config missing file",
        lambda e: config_lib.parse(TrainConfig, path=e.tmp / "nope.yaml"),
        config_lib.ConfigError,
        r"nope.yaml",
    ),
    Case(
        "config file not a mapping",
        lambda e: config_lib.parse(TrainConfig, path=e.tmp / "config.yaml"),
        config_lib.ConfigError,
        r"config.yaml",
        lambda e: yaml_file(e, "- 1\n- 2\n"),
    ),
    Case(
        "config file unknown key",
        lambda e: config_lib.parse(TrainConfig, path=e.tmp / "config.yaml"),
        config_lib.ConfigError,
        r"Unknown config key `epoch`",
        lambda e: yaml_file(e, "epoch: 3\n"),
    ),
    Case(
        "config file not YAML",
        lambda e: config_lib.parse(TrainConfig, path=e.tmp / "config.yaml"),
        config_lib.ConfigError,
        r"config.yaml' is not valid YAML",
        lambda e: yaml_file(e, "lr: [0.1\n"),
    ),
    Case(
        "config schema not a dataclass",
        lambda e: config_lib.parse(dict, []),
        TypeError,
        r"`schema` must be a dataclass type, got <class 'dict'>",
    ),
]


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for root in roots
        for p in sorted(root.rglob("*"))
        if p.name != "jddp.lease"
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    if jax.device_count() != 8:
        pytest.skip("needs the 8 simulated devices of conftest.py")
    model = models.pytree()
    dp = jddp.DataParallel(model.loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())
    disk = tmp_path_factory.mktemp("disk")
    with jddp.Checkpointer(disk, config={"lr": 0.1}) as c:
        c.save(dp.init(model.params), wait=True)
    (disk / "data.npy").write_bytes(b"\x93NUMPY")
    return model, dp, disk


def test_the_catalogue_is_large_and_its_ids_unique():
    ids = [case.id for case in CASES]
    assert len(ids) >= 70 and len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.multiprocess] if c.starts_processes else []) for c in CASES],
    ids=[case.id for case in CASES],
)
def test_a_mistake_is_a_clear_error_and_changes_nothing(case: Case, base, tmp_path):
    model, dp, disk = base
    env = Env(dp, dp.init(model.params), model, disk, tmp_path)
    if case.setup is not None:
        case.setup(env)
    before = snapshot(disk, tmp_path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jddp.data.DtypeWarning)
            with pytest.raises(case.error, match=case.match):
                case.call(env)
        assert snapshot(disk, tmp_path) == before
    finally:
        if env.writer is not None:
            env.writer.close()
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(env.state))
    state, metrics = dp.step(env.state, env.batch())
    assert int(state.step) == 1 and np.isfinite(metrics["loss"])
