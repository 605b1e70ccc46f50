"""Every run says its topology once, on the main process: ``jddp: 8 devices (cpu), 1 process x 8 local devices``,
whether or not the script calls ``jddp.initialize`` (``data_mesh``'s first call and ``fit`` say it too); and ``jddp
info`` under the launcher's ``JDDP_LOCAL_DEVICES`` reports those devices."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from jddp.runtime import distributed
from tests import multiprocess

LINE = "jddp: 8 devices (cpu), 1 process x 8 local devices"


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=multiprocess.environment(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_line_for_one_process_with_8_devices():
    assert distributed.topology_line() == LINE  # the root conftest simulates 8 CPU devices


@pytest.mark.multiprocess  # starts a process of its own
def test_a_script_without_initialize_says_it_once_at_its_first_mesh():
    done = run(
        """
        import jax
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
        import jddp
        jddp.data_mesh()
        jddp.data_mesh(jax.devices()[:2])
        """
    )
    assert [line for line in done.stderr.splitlines() if line.startswith("jddp:")] == [LINE], done.stderr
    assert LINE not in done.stdout


@pytest.mark.multiprocess  # starts a process of its own
def test_initialize_with_the_launchers_devices_then_fit_says_it_once():
    """``JDDP_LOCAL_DEVICES=8`` as ``jddp launch -n 1 --devices-per-process 8`` sets it; ``fit`` on a mesh built
    without ``data_mesh`` says nothing more."""
    done = run(
        """
        import numpy as np, jax, jax.numpy as jnp, optax
        import jddp
        jddp.initialize()
        mesh = jax.sharding.Mesh(jax.devices(), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

        def loss_fn(params, model_state, batch, key):
            return jddp.masked_mean((batch["x"] @ params["w"]) ** 2, batch["mask"]), (model_state, {})

        dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
        state = dp.init({"w": np.ones((2,), np.float32)})
        loader = jddp.data.DataLoader({"x": np.ones((16, 2), np.float32)}, global_batch_size=8, mesh=mesh)
        jddp.fit(dp, state, loader, steps=2, progress=False)
        """,
        JDDP_LOCAL_DEVICES="8",
    )
    said = [line for line in done.stderr.splitlines() if line.startswith("jddp:") and "compilation cache" not in line]
    assert said == [LINE], done.stderr


@pytest.mark.multiprocess  # starts a process of its own
def test_fit_says_it_when_nothing_else_did():
    done = run(
        """
        import jax
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", 8)
        import numpy as np, optax
        import jddp
        mesh = jax.sharding.Mesh(jax.devices(), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

        def loss_fn(params, model_state, batch, key):
            return jddp.masked_mean((batch["x"] @ params["w"]) ** 2, batch["mask"]), (model_state, {})

        dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
        state = dp.init({"w": np.ones((2,), np.float32)})
        loader = jddp.data.DataLoader({"x": np.ones((16, 2), np.float32)}, global_batch_size=8, mesh=mesh)
        jddp.fit(dp, state, loader, steps=2, progress=False)
        """
    )
    assert [line for line in done.stderr.splitlines() if line.startswith("jddp:")] == [LINE], done.stderr


@pytest.mark.multiprocess  # starts a process of its own
def test_jddp_info_under_the_launchers_local_devices():
    done = run("from jddp.cli import main; main.main(['info'])", JDDP_LOCAL_DEVICES="8")
    rows = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert rows["local_devices"] == "8" and rows["global_devices"] == "8" and rows["process_count"] == "1", rows
    assert rows["topology"] == LINE.removeprefix("jddp: "), rows


@pytest.mark.multiprocess  # starts a process of its own
def test_jddp_info_refuses_a_bad_local_devices_variable_naming_it():
    done = subprocess.run(
        [sys.executable, "-m", "jddp.cli.main", "info"],
        env=multiprocess.environment(JDDP_LOCAL_DEVICES="eight"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "$JDDP_LOCAL_DEVICES='eight' must be" in done.stderr, done.stderr
