"""Runtime basics: the data mesh, shardings, simulated devices and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jddp
from jddp.cli import main as cli


def test_data_mesh_covers_every_device_in_process_order():
    mesh = jddp.data_mesh()
    assert mesh.axis_names == ("data",)
    assert mesh.shape["data"] == jax.device_count()
    assert [d.id for d in mesh.devices] == sorted(d.id for d in jax.devices())
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,)


def test_batch_sharding_splits_rows_in_order():
    mesh = jddp.data_mesh()
    x = np.arange(jax.device_count() * 2)
    arr = jax.device_put(x, jddp.batch_sharding(mesh))
    for shard in arr.addressable_shards:
        i = list(mesh.devices).index(shard.device)
        np.testing.assert_array_equal(np.asarray(shard.data), x[2 * i : 2 * i + 2])
    rep = jax.device_put(x, jddp.replicated(mesh))
    assert all(np.array_equal(np.asarray(s.data), x) for s in rep.addressable_shards)


def test_data_mesh_rejects_no_devices():
    with pytest.raises(ValueError, match=r"`devices` is empty"):
        jddp.data_mesh([])


def test_simulate_after_backend_started_raises():
    jax.devices()  # the backend is running (8 devices from conftest)
    jddp.simulate_cpu_devices(jax.device_count())  # same count: a no-op
    with pytest.raises(RuntimeError, match=r"simulate_cpu_devices\(n=3\)` must run before JAX starts.*8 device"):
        jddp.simulate_cpu_devices(3)


@pytest.mark.parametrize("n", [0, -2, 1.5, True], ids=["zero", "negative", "float", "bool"])
def test_simulate_rejects_bad_counts(n):
    with pytest.raises(ValueError, match=r"`n` must be an int >= 1, got n="):
        jddp.simulate_cpu_devices(n)


@pytest.mark.multiprocess  # starts a process of its own
def test_simulate_in_a_fresh_process():
    code = "import jddp; jddp.simulate_cpu_devices(3); import jax; print(jax.device_count(), jax.default_backend())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["3", "cpu"]


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"jddp {jddp.__version__}"


def test_cli_info_reports_devices():
    text = cli.info()
    rows = dict(line.split(": ", 1) for line in text.splitlines())
    assert rows["jax"] == jax.__version__
    assert rows["backend"] == "cpu"
    assert int(rows["local_devices"]) == jax.local_device_count()
    assert int(rows["process_count"]) == 1


@pytest.mark.multiprocess  # starts a process of its own
def test_cli_info_console_script_in_fresh_process():
    out = subprocess.run(
        [sys.executable, "-m", "jddp.cli.main", "info", "--simulate-devices", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "global_devices: 2" in out.stdout and "process_count: 1" in out.stdout


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"verbose": "no"}, TypeError, r"`verbose` must be True or False, got verbose='no'"),
        ({"shutdown_timeout_s": -1.0}, ValueError, r"`shutdown_timeout_s` must be a finite number > 0.0 \(seconds\)"),
        ({"local_devices": 2.5}, ValueError, r"`local_devices` must be an int >= 1 or None, got local_devices=2.5"),
        ({"bind_address": b"x"}, TypeError, r"`bind_address` must be a non-empty str or None"),
    ],
    ids=["verbose", "shutdown_timeout_s", "local_devices", "bind_address"],
)
def test_initialize_refuses_a_wrong_argument_before_taking_the_launchers_stdout(monkeypatch, kwargs, error, match):
    """``initialize`` checks its arguments before it does anything: here, before it takes over the stdout pipe that
    ``jddp launch`` passes in ``JDDP_STDOUT_FD`` (which it reads once and removes from the environment)."""
    monkeypatch.setenv("JDDP_STDOUT_FD", "987")
    with pytest.raises(error, match=match):
        jddp.initialize(**kwargs)
    assert os.environ.get("JDDP_STDOUT_FD") == "987"  # left for a corrected call to take


def test_barrier_refuses_a_wrong_timeout_even_alone():
    """In a single process ``barrier`` is a no-op, yet a wrong timeout is refused there too, not first in a group."""
    with pytest.raises(ValueError, match=r"`timeout_s` must be a finite number > 0.0 \(seconds\), got timeout_s=inf"):
        jddp.barrier("ready", timeout_s=float("inf"))
    with pytest.raises(TypeError, match=r"`name` must be a non-empty str, got name=''"):
        jddp.barrier("")
