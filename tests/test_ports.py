"""The published-script ports that own their train step (``examples/*_port/original.py`` -> ``train.py``): how many
lines the port changed, and that the port trains as one device does on every layout and resumes bitwise."""

from __future__ import annotations

import difflib
import os
import re
import shutil
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


def _command(module: str, launch: bool) -> list[str]:
    """``python -m module``, alone or under ``jddp launch`` as 2 processes x 2 devices."""
    if launch:
        return [sys.executable, "-m", "jddp.launch", "-n", "2", "--devices-per-process", "2", "-m", module]
    return [sys.executable, "-m", module]


def _resume_from_first_save(done: Path, name: str) -> Path:
    """A copy of the finished run ``done`` holding its first checkpoint only: the run stopped after its first save,
    as a killed run would be, so that the same script resumed there must end as ``done`` did."""
    resumed = done.parent / name
    shutil.copytree(done, resumed)
    steps = sorted(int(p.name) for p in (resumed / "ckpt").iterdir() if p.name.isdigit())
    assert steps, f"{done}: no checkpoint saved"
    for step in steps[1:]:
        shutil.rmtree(resumed / "ckpt" / str(step))
    return resumed


# The SST-2 port at a small size: 256 training sentences (2 batches of 64 per epoch, of lengths up to 16 and up to
# 32: two programs), 64 validation sentences in 4 buckets of 16 tokens (4 more), 2 epochs (a save after each).
SST2_SIZE = ("--train-size", "256", "--eval-size", "64", "--bucket-size", "16", "--epochs", "2")


def _sst2(tmp_path: Path, name: str, devices: int, launch: bool = False) -> tuple[Path, str]:
    workdir = tmp_path / name
    out = _run(
        [*_command("examples.sst2_port.train", launch), *SST2_SIZE, "--workdir", str(workdir)], tmp_path, devices
    )
    return workdir, out


def _sst2_params(workdir: Path):
    from examples.sst2_port import train

    config = train.Config()
    template = train.create_train_state(jax.random.key(0), config, train.model_from_config(config))
    with jddp.Checkpointer(workdir / "ckpt", read_only=True) as reader:
        state = reader.restore_or_init(template)
    return int(state.step), [np.asarray(x) for x in jax.tree.leaves(state.params)]


def _max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sst2_port_equals_one_device_on_8_and_2x2_and_resumes_bitwise(tmp_path):
    """Dropout and word dropout on (rng="example"), bucketed batches of two lengths: 1 device, 8 devices, 2 processes
    x 2 devices; and the 8-device run resumed from its first epoch's checkpoint, bitwise equal to the uninterrupted
    run (the loader's position restored: it trains the second epoch only)."""
    step, one = _sst2_params(_sst2(tmp_path, "one", 1)[0])
    assert step > 0
    for name, devices, launch in (("eight", 8, False), ("two_by_two", 2, True)):
        other_step, other = _sst2_params(_sst2(tmp_path, name, devices, launch)[0])
        assert other_step == step, f"{name}: step {other_step}, one device: {step}"
        worst = _max_difference(one, other)
        assert worst < 2e-5, f"{name}: parameters differ from one device's by up to {worst:.3g} (bound 2e-5)"
        print(f"sst2 {name}: max |params - one device's| = {worst:.3g}")
    _resume_from_first_save(tmp_path / "eight", "resumed")
    _, resumed_out = _sst2(tmp_path, "resumed", 8)
    assert "train epoch 001" not in resumed_out and "train epoch 002" in resumed_out, resumed_out[-3000:]
    _, resumed = _sst2_params(tmp_path / "resumed")
    _, eight = _sst2_params(tmp_path / "eight")
    differing = [i for i, (a, b) in enumerate(zip(resumed, eight, strict=True)) if a.tobytes() != b.tobytes()]
    assert not differing, f"resumed != uninterrupted in leaves {differing}: up to {_max_difference(resumed, eight):.3g}"


def _rnn(tmp_path: Path, name: str, devices: int, steps: int, launch: bool = False) -> list[float]:
    args = [*_command("examples.eqx_rnn_port.train", launch), "--steps", str(steps), "--workdir"]
    out = _run([*args, str(tmp_path / name)], tmp_path, devices)
    return [float(v) for v in re.findall(r"^(?:\[0\] )?step=\d+, loss=(\S+)$", out, re.M)]  # process 0's


@pytest.mark.multiprocess
@pytest.mark.slow
def test_equinox_rnn_port_equals_one_device_on_8_and_2x2_and_resumes_bitwise(tmp_path):
    """60 steps on 1 device, 8 devices and 2 processes x 2 devices (``jddp launch``): the same losses; the 8-device
    run resumed from its checkpoint of step 50 (``save_every=50``) repeats steps 50..59 bitwise."""
    one = _rnn(tmp_path, "one", 1, 60)
    assert len(one) == 60
    losses = {}
    for name, devices, launch in (("eight", 8, False), ("two_by_two", 2, True)):
        losses[name] = other = _rnn(tmp_path, name, devices, 60, launch)
        assert len(other) == 60, f"{name}: {len(other)} steps printed"
        worst = float(np.max(np.abs(np.subtract(other, one))))
        message = f"{name}: losses differ from one device's by up to {worst:.3g}"
        np.testing.assert_allclose(other, one, rtol=2e-5, atol=1e-6, err_msg=message)
        print(f"eqx_rnn {name}: max |loss - one device's| = {worst:.3g}")
    _resume_from_first_save(tmp_path / "eight", "resumed")
    resumed = _rnn(tmp_path, "resumed", 8, 60)  # steps 50..59 again, from the checkpoint
    assert resumed == losses["eight"][50:], f"resumed {resumed} != uninterrupted {losses['eight'][50:]}"
