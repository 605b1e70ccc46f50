"""The published-script ports that own their train step (``examples/*_port/original.py`` -> ``train.py``): how many
lines the port changed, and that the port trains as one device does on every layout and resumes bitwise."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jddp
from tests import multiprocess

ROOT = multiprocess.ROOT
PORTS = sorted(p.parent for p in (ROOT / "examples").glob("*_port/original.py"))
LIMIT = 40  # the bound: lines added plus lines removed in the training code


def changed_lines(port: Path) -> tuple[int, int]:
    """Lines added and removed from ``original.py`` to ``train.py`` (a unified diff's ``+`` and ``-`` lines)."""
    a = (port / "original.py").read_text().splitlines()
    b = (port / "train.py").read_text().splitlines()
    diff = [d for d in difflib.unified_diff(a, b, lineterm="", n=0) if not d.startswith(("+++", "---", "@@"))]
    return sum(d.startswith("+") for d in diff), sum(d.startswith("-") for d in diff)


def test_there_are_ports():
    assert {p.name for p in PORTS} >= {"sst2_port", "eqx_rnn_port"}


@pytest.mark.parametrize("port", PORTS, ids=[p.name for p in PORTS])
def test_each_port_changes_fewer_than_40_lines_and_shares_the_model_and_data(port):
    added, removed = changed_lines(port)
    assert added + removed < LIMIT, f"{port.name}: +{added} -{removed}"
    # The model and the data pipeline are the original's: both scripts import the same modules, or hold them
    # verbatim (a port that rewrote its model would show here).
    a, b = ((port / f).read_text() for f in ("original.py", "train.py"))
    for name in re.findall(r"^class (\w+)", a, re.M):
        block = re.search(rf"^class {name}\b.*?(?=^\S)", a, re.M | re.S)
        assert block is not None and block.group(0) in b, f"{port.name}: class {name} changed in the port"


def _run(args: list[str], tmp_path: Path, devices: int, timeout: float = 900) -> str:
    env = {**os.environ, "JDDP_LOCAL_DEVICES": str(devices), "JDDP_COMPILATION_CACHE": str(tmp_path / "xla")}
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _sst2(tmp_path: Path, name: str, devices: int, epochs: int, launch: bool = False) -> Path:
    workdir = tmp_path / name
    script = ["-m", "examples.sst2_port.train", "--epochs", str(epochs), "--train-size", "256", "--workdir"]
    if launch:
        cmd = [sys.executable, "-m", "jddp.launch", "-n", "2", "--devices-per-process", "2", *script]
        _run([*cmd, str(workdir)], tmp_path, devices)
    else:
        _run([sys.executable, *script, str(workdir)], tmp_path, devices)
    return workdir


def _sst2_params(workdir: Path):
    from examples.sst2_port import train

    config = train.Config()
    template = train.create_train_state(jax.random.key(0), config, train.model_from_config(config))
    with jddp.Checkpointer(workdir / "ckpt", read_only=True) as reader:
        state = reader.restore_or_init(template)
    return int(state.step), [np.asarray(x) for x in jax.tree.leaves(state.params)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sst2_port_equals_one_device_on_8_and_2x2_and_resumes_bitwise(tmp_path):
    """Dropout and word dropout on (rng="example"), bucketed batches: 1 device, 8 devices, 2 processes x 2
    devices; and an 8-device run stopped after its first epoch and resumed, bitwise equal to the uninterrupted."""
    step, one = _sst2_params(_sst2(tmp_path, "one", 1, 2))
    assert step > 0
    for name, kwargs in (("eight", {"devices": 8}), ("two_by_two", {"devices": 2, "launch": True})):
        other_step, other = _sst2_params(_sst2(tmp_path, name, epochs=2, **kwargs))
        assert other_step == step
        worst = max(float(np.max(np.abs(a - b))) for a, b in zip(one, other, strict=True))
        assert worst < 2e-5, (name, worst)
    _sst2(tmp_path, "resumed", 8, 1)
    resumed_dir = _sst2(tmp_path, "resumed", 8, 2)
    _, resumed = _sst2_params(resumed_dir)
    _, eight = _sst2_params(tmp_path / "eight")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(resumed, eight, strict=True))


def _rnn(tmp_path: Path, name: str, devices: int, steps: int) -> list[float]:
    args = [sys.executable, "-m", "examples.eqx_rnn_port.train", "--steps", str(steps), "--workdir"]
    out = _run([*args, str(tmp_path / name)], tmp_path, devices)
    return [float(v) for v in re.findall(r"^step=\d+, loss=(\S+)$", out, re.M)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_equinox_rnn_port_equals_one_device_on_8_and_resumes_bitwise(tmp_path):
    one = _rnn(tmp_path, "one", 1, 70)
    eight = _rnn(tmp_path, "eight", 8, 70)
    assert len(one) == len(eight) == 70
    np.testing.assert_allclose(eight, one, rtol=2e-5, atol=1e-6)
    _rnn(tmp_path, "resumed", 8, 60)  # saved at step 50 (save_every=50)
    resumed = _rnn(tmp_path, "resumed", 8, 70)  # steps 50..69 again, from the checkpoint
    assert resumed == eight[50:]
