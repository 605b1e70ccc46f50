"""Every device program jddp compiles, lowered for ``cuda``, ``rocm`` and ``tpu`` on this CPU machine (no device):
each lowers, holds no host callback and no custom call, and is the very program the suite compiles and checks on CPU
(the same StableHLO: collectives, donation and shardings as on CPU); and, read from the text itself, its collectives
are the ones the design promises (kind, count, dtype, bytes). Planted CPU-only constructs are refused by name.

The programs come from a grid of the engine's options that change the program (accumulation, the all-reduce's
dtype, packing, ZeRO-1), plus evaluation and the replica check, so an option added to the grid is covered on every
platform at once.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jddp
from jddp.engine import comm
from tests import models

ACCELERATORS = ("cuda", "rocm", "tpu")
DEVICES = 8
GRID = [
    dict(accumulate_steps=a, reduce_dtype=r, fuse_allreduce=f, shard_optimizer=z)
    for a, r, f, z in itertools.product((1, 4), (None, jnp.bfloat16), (None, False), (False, True))
    if not (z and f is None)  # ZeRO-1's reduce-scatter is per leaf: packing does not apply
]


def grid_id(options: dict) -> str:
    r = "bf16" if options["reduce_dtype"] is not None else "f32"
    f = "packed" if options["fuse_allreduce"] is None else "per-leaf"
    return f"acc{options['accumulate_steps']}-{r}-{f}{'-zero1' if options['shard_optimizer'] else ''}"


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < DEVICES:
        pytest.skip(f"needs {DEVICES} devices")
    return jddp.data_mesh(jax.devices()[:DEVICES])


def engine(mesh, loss_fn=None, **options):
    model = models.pytree()
    dp = jddp.DataParallel(loss_fn or model.loss_fn, optax.adam(1e-3), mesh=mesh, **options)
    state = dp.init(model.params, model_state=model.model_state)
    batch = jax.device_put(models.batch(32), NamedSharding(mesh, P("data")))
    return dp, state, batch


def grad_bytes(params, dtype) -> int:
    return sum(np.asarray(x).size for x in jax.tree.leaves(params)) * np.dtype(dtype).itemsize


def check_portable(text: str, platform: str) -> None:
    report = comm.CommReport.from_lowered(text, platform=platform)
    assert report.custom_calls == (), f"custom calls in a jddp program lowered for {platform}: {report.custom_calls}"
    assert report.notes == ()


@pytest.mark.parametrize("options", GRID, ids=[grid_id(o) for o in GRID])
def test_the_step_lowers_for_every_accelerator_as_the_program_checked_on_cpu(mesh, options):
    dp, state, batch = engine(mesh, **options)
    on_cpu = dp.lower(state, batch, platform="cpu").as_text()
    for platform in ACCELERATORS:
        text = dp.lower(state, batch, platform=platform).as_text()
        check_portable(text, platform)
        assert text == on_cpu, f"the step lowered for {platform} differs from the one compiled and tested on CPU"
    report = dp.comm_report(state, batch, platform="cuda")
    assert report.platform == "cuda" and report.collectives == report.lowered
    grads = grad_bytes(state.params, options["reduce_dtype"] or np.float32)
    scalars = 64  # the loss, the counts and the metrics travel with the gradients: a few scalars
    leaves = len(jax.tree.leaves(state.params))
    if options["shard_optimizer"]:
        # A reduce-scatter of each (padded) gradient leaf; the all-gather of the updated parameters is the output
        # sharding's, inserted by XLA's partitioner when it compiles (counted on CPU by tests/test_zero.py).
        assert report.count("reduce-scatter") == leaves and report.count("all-gather") == 0
        assert grads <= report.nbytes("reduce-scatter") <= grads + leaves * DEVICES * 4
        assert report.nbytes("all-reduce") <= scalars
    else:
        assert {c.op for c in report.collectives} == {"all-reduce"}
        if options["fuse_allreduce"] is None:  # packed: one op per dtype (bf16 gradients beside f32 scalars)
            assert report.count("all-reduce") == len({c.dtypes for c in report.collectives})
        else:  # per leaf: one op for each gradient leaf, with the scalars
            assert report.count("all-reduce") >= leaves
        assert grads <= report.nbytes("all-reduce") <= grads + scalars, (report.nbytes("all-reduce"), grads)
        wire = "bf16" if options["reduce_dtype"] is not None else "f32"  # the gradients' dtype on the wire
        assert all(c.dtypes == (wire,) for c in report.collectives if c.nbytes > scalars), report.table()
    donated = len(jax.tree.leaves((state.step, state.params, state.opt_state, state.model_state)))
    assert on_cpu.count("tf.aliasing_output") == donated  # the state is donated, on every platform alike


def test_evaluation_and_the_replica_check_lower_for_every_accelerator(mesh):
    dp, state, batch = engine(mesh)
    for program in ("eval", "replica_check"):
        on_cpu = dp.lower(state, batch, platform="cpu", program=program).as_text()
        for platform in ACCELERATORS:
            text = dp.lower(state, batch, platform=platform, program=program).as_text()
            check_portable(text, platform)
            assert text == on_cpu
        report = comm.CommReport.from_lowered(on_cpu, platform="cpu")
        if program == "eval":  # sums of the metrics and their weights only, nothing donated
            assert {c.op for c in report.collectives} == {"all-reduce"} and report.nbytes("all-reduce") <= 64
            assert "tf.aliasing_output" not in on_cpu
        else:  # each device's checksums of every replicated leaf, gathered
            assert {c.op for c in report.collectives} == {"all-gather"}


def test_a_host_callback_in_the_loss_is_named_for_cpu_and_refused_for_an_accelerator(mesh):
    """Planted: a ``jax.debug.callback`` in the loss (Python on the host every step)."""
    model = models.pytree()

    def loss_fn(params, model_state, batch, rng):
        loss, aux = model.loss_fn(params, model_state, batch, rng)
        jax.debug.callback(lambda x: None, loss)
        return loss, aux

    dp, state, batch = engine(mesh, loss_fn)
    report = comm.CommReport.from_lowered(dp.lower(state, batch, platform="cpu").as_text(), platform="cpu")
    assert any("host callback `xla_ffi_python_cpu_callback`" in note for note in report.notes), report.notes
    with pytest.raises(ValueError, match=r"cannot be lowered for platform='cuda'"):
        dp.lower(state, batch, platform="cuda")


def test_a_cpu_only_primitive_is_refused_for_an_accelerator(mesh):
    """Planted: a primitive whose only lowering is for CPU (as ``mpi4jax``'s is), in the loss."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, mlir

    cpu_only = Primitive("jddp_test_cpu_only")
    cpu_only.def_abstract_eval(lambda x: x)
    cpu_only.def_impl(lambda x: x)
    ad.deflinear(cpu_only, lambda t: [cpu_only.bind(t)])
    mlir.register_lowering(cpu_only, lambda ctx, x: [x], platform="cpu")
    model = models.pytree()

    def loss_fn(params, model_state, batch, rng):
        loss, aux = model.loss_fn(params, model_state, batch, rng)
        return cpu_only.bind(loss), aux

    dp, state, batch = engine(mesh, loss_fn)
    dp.lower(state, batch, platform="cpu")
    for platform in ACCELERATORS:
        with pytest.raises(ValueError, match=rf"cannot be lowered for platform='{platform}'.*jddp_test_cpu_only"):
            dp.lower(state, batch, platform=platform)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"platform": "gpu"}, ValueError, r"`platform` must be one of 'cpu', 'cuda', 'rocm', 'tpu'.*platform='gpu'"),
        ({"program": "train"}, ValueError, r"`program` must be one of 'step', 'eval', 'replica_check', got"),
    ],
    ids=["platform", "program"],
)
def test_lower_refuses_what_it_does_not_know(mesh, kwargs, error, match):
    dp, state, batch = engine(mesh)
    with pytest.raises(error, match=match):
        dp.lower(state, batch, **kwargs)
