"""The MPI transport (``transport="mpi"``, ``jddp launch --transport mpi``): exactness against the gloo transport,
failures named within the bound, and every misuse refused. Skipped where the ``jddp[mpi]`` extra is not installed
(CI installs it)."""

from __future__ import annotations

import re
import sys
import time

import numpy as np
import optax
import pytest

import jddp
from jddp.cli import launch as launch_lib
from jddp.cli import output
from jddp.engine import mpi
from jddp.runtime import join_settings
from tests import multiprocess
from tests.workers import train_mlp

pytestmark = pytest.mark.multiprocess
needs_mpi = pytest.mark.skipif(mpi.unavailable() is not None, reason=f"no MPI transport here: {mpi.unavailable()}")
TRAIN = str(multiprocess.WORKERS / "train_mlp.py")
GROUP = str(multiprocess.WORKERS / "group.py")


def params(path) -> dict[str, np.ndarray]:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@needs_mpi
def test_mpi_transport_trains_to_the_parameters_of_the_gloo_transport(tmp_path):
    """20 AdamW steps of the MNIST-1D MLP at 2 processes: the same parameters to 1e-6 through MPI_Allreduce as
    through gloo, with no XLA all-reduce left in the MPI step; the output is prefixed and free of gloo's chatter."""
    data = {"TRAIN_MLP_DATA": train_mlp.data_file(tmp_path / "data.npz")}  # read by every process, generated once
    via_mpi = multiprocess.launch(
        "--transport", "mpi", "-n", "2", TRAIN, str(tmp_path / "mpi.npz"), "20", timeout=600, env=data
    )  # fmt: skip
    via_gloo = multiprocess.launch("-n", "2", TRAIN, str(tmp_path / "gloo.npz"), "20", timeout=600, env=data)
    assert via_mpi.returncode == 0, via_mpi.stdout[-2000:] + via_mpi.stderr[-3000:]
    assert via_gloo.returncode == 0, via_gloo.stdout[-2000:] + via_gloo.stderr[-3000:]
    assert re.search(r"^\[0\] RESULT devices=2 processes=2 .* allreduce_ops=0 ", via_mpi.stdout, re.M), via_mpi.stdout
    assert re.search(r"^\[0\] RESULT devices=2 processes=2 .* allreduce_ops=1 ", via_gloo.stdout, re.M)
    assert not output.GLOO_PIECES.search((via_mpi.stdout + via_mpi.stderr).encode()), via_mpi.stdout
    for line in via_mpi.stdout.splitlines():
        assert line[:4] in ("[0] ", "[1] "), line
    a, b = params(tmp_path / "mpi.npz"), params(tmp_path / "gloo.npz")
    assert a.keys() == b.keys() and len(a) == 6
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-6, err_msg=k)
    start = np.load(tmp_path / "gloo.npz")  # the run moved the parameters: the comparison is not of two inits
    assert any(np.abs(start[k]).sum() > 0 for k in start.files)


@needs_mpi
@pytest.mark.parametrize("how", ["exit0", "sigkill"])
def test_mpi_transport_a_process_that_ends_early_ends_the_group_naming_it(how):
    """Process 1 returns early (its peer, blocked in MPI_Allreduce, is named by jddp's watchdog: exit 69) or is
    SIGKILLed (mpiexec ends the group at once, naming the pid and the signal): either way within the bound."""
    peer_timeout = 5
    started = time.time()
    done = multiprocess.launch(
        "--transport", "mpi", "-n", "2", "--peer-timeout", str(peer_timeout), GROUP, "end", "1", how, timeout=300
    )
    ended = time.time()
    shown = done.stdout[-2000:] + done.stderr[-3000:]
    ending = [line for line in done.stdout.splitlines() if "ENDING" in line]
    assert ending, shown
    assert ended - float(ending[0].split()[-1]) < peer_timeout + 10, shown
    if how == "exit0":
        assert done.returncode == 69, shown
        assert re.search(r"\[0\] jddp: process 0 of 2 waited \d+ s for process\(es\) \[1\], which ended early", shown)
    else:
        assert done.returncode == 9, shown
        assert "EXIT CODE: 9" in done.stdout + done.stderr and "Killed (signal 9)" in done.stdout + done.stderr
        assert "the group under mpiexec failed with exit code 9; no restart left" in done.stderr, shown
    assert ended - started < 240


@needs_mpi
def test_mpi_transport_restarts_the_group_under_mpiexec():
    done = multiprocess.launch(
        "--transport", "mpi", "-n", "2", "--max-restarts", "1", "--peer-timeout", "10", GROUP, "die", "1", "12", "1"
    )
    shown = done.stdout[-2000:] + done.stderr[-3000:]
    assert done.returncode == 0, shown
    assert "the group under mpiexec failed with exit code 9; restarting it (1 of 1)" in done.stderr, shown
    assert sorted(line for line in done.stdout.splitlines() if "DONE" in line) == [
        "[0] DONE 0 attempt 1",
        "[1] DONE 1 attempt 1",
    ], shown


def loss_fn(p, s, b, r):
    return ((b["x"] @ p["w"]) ** 2).mean(), (s, {})


def test_transport_must_be_xla_or_mpi(monkeypatch):
    with pytest.raises(ValueError, match=r"`transport` must be 'xla' .* or 'mpi' .*got 'gloo'"):
        jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), transport="gloo")  # pyright: ignore
    monkeypatch.setenv("JDDP_TRANSPORT", "nccl")
    with pytest.raises(ValueError, match=r"\$JDDP_TRANSPORT='nccl' must be one of xla, mpi"):
        jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh())


def test_mpi_transport_refuses_zero_1():
    with pytest.raises(ValueError, match=r"transport='mpi' .*shard_optimizer=True needs a reduce-scatter"):
        jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), transport="mpi", shard_optimizer=True)


@needs_mpi
def test_mpi_transport_refuses_several_devices_in_a_process():
    """The pytest process holds 8 devices (conftest) and is an MPI world of one."""
    with pytest.raises(ValueError, match=r"one device per process, got a mesh of 8 device\(s\) over 1 process"):
        jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), transport="mpi")


def test_without_mpi4jax_the_mpi_transport_says_why_and_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4jax", None)  # import fails as where it is not installed
    assert "pip install" in (mpi.unavailable() or "")
    missing = r"transport='mpi' needs mpi4jax and an MPI library: (ModuleNotFound|Import)Error.*pip"
    with pytest.raises(RuntimeError, match=missing):
        jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=jddp.data_mesh(), transport="mpi")


def test_started_by_mpiexec_without_mpi4py_is_an_error_not_a_lone_run(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(RuntimeError, match=r"rank 1 of 4 \(PMI_RANK, PMI_SIZE\), but mpi4py cannot be imported"):
        join_settings.from_mpi()
    monkeypatch.setenv("PMI_SIZE", "1")  # a world of one: nothing to join
    assert join_settings.from_mpi() is None


def test_launcher_refuses_mpi_with_several_nodes_or_devices():
    for extra in ({"nnodes": 2, "coordinator": "10.0.0.1:29500"}, {"devices_per_process": 2}, {"cpu_share": True}):
        with pytest.raises(ValueError, match=r"--transport mpi runs one device per process on this node"):
            launch_lib.LaunchConfig(target="train", module=True, transport="mpi", **extra)


@needs_mpi
def test_mpi_psum_of_packed_and_large_leaves_of_several_dtypes_equals_numpy():
    done = multiprocess.launch("--transport", "mpi", "-n", "2", str(multiprocess.WORKERS / "mpi_sum.py"), timeout=300)
    shown = done.stdout[-2000:] + done.stderr[-3000:]
    assert done.returncode == 0, shown
    assert sorted(line for line in done.stdout.splitlines() if "SUMS OK" in line) == ["[0] SUMS OK 0", "[1] SUMS OK 1"]


def test_mpi_psum_refuses_a_dtype_mpi_cannot_sum_naming_it():
    import jax.numpy as jnp

    with pytest.raises(TypeError, match=r"cannot sum a value of dtype bool \(shape \(3,\)\).*Cast the value"):
        mpi._wire(jnp.zeros(3, bool), np.dtype(bool))
    assert mpi._wire(jnp.ones(2, jnp.bfloat16), np.dtype(jnp.bfloat16)).dtype == jnp.float32
