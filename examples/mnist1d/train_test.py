"""A short MNIST-1D run per model: it learns, 8 devices train like 1, and the config is checked before any JAX work."""

import dataclasses
import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest

from examples.mnist1d import train
from jddp import config as config_lib
from jddp import logs
from tests import multiprocess

CONFIGS = train.DEFAULT_CONFIG.parent


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_trains_above_chance(model, tmp_path):
    config = config_lib.parse(train.Config, [f"config={CONFIGS / f'mnist1d_{model}.yaml'}"])
    config = dataclasses.replace(
        config, epochs=8, num_samples=1000, global_batch_size=64, hidden=64, channels=16,
        learning_rate=1e-2, log_dir=str(tmp_path), progress=False,
    )  # fmt: skip
    result = train.main(config)
    assert result["steps"] == 8 * (800 // 64)
    assert result["train_loss"] < 0.8 * math.log(10)  # from about ln(10) at the start
    assert result["test_accuracy"] > 0.3  # chance is 0.1
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "config.yaml").exists()
    assert "devices: 8" in (tmp_path / "config.yaml").read_text().splitlines()  # devices=0 is all: the 8 it had


def run_example(devices: int, log_dir, *overrides: str) -> list[dict]:
    """Runs the example in a fresh process on ``devices`` simulated devices; returns its train records."""
    done = subprocess.run(
        [sys.executable, "-m", "examples.mnist1d.train", f"devices={devices}", f"log_dir={log_dir}", *overrides],
        env=multiprocess.environment(),
        cwd=multiprocess.ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [r for r in logs.read_metrics(log_dir / "metrics.jsonl") if r.get("split") == "train"]


@pytest.mark.slow
def test_eight_devices_train_like_one(tmp_path):
    """Step by step, 8 devices log the loss and the gradient norm of 1 device, to float32 round-off.

    Tight enough that a gradient scaled by the device count fails (its norm is 8x), which AdamW's
    scale invariance would hide from the loss alone.
    """
    overrides = ("epochs=2", "num_samples=1000", "global_batch_size=64", "hidden=64", "log_every=1", "progress=false")
    one = run_example(1, tmp_path / "one", *overrides)
    eight = run_example(8, tmp_path / "eight", *overrides)
    assert [r["step"] for r in one] == [r["step"] for r in eight] == list(range(1, 2 * (800 // 64) + 1))
    for key in ("loss", "grad_norm", "accuracy"):
        np.testing.assert_allclose([r[key] for r in eight], [r[key] for r in one], rtol=2e-5, atol=1e-6, err_msg=key)


def test_configs_load_and_overrides_are_checked():
    assert config_lib.parse(train.Config, [], path=train.DEFAULT_CONFIG).model is train.Model.mlp
    cnn = config_lib.parse(train.Config, [f"config={CONFIGS / 'mnist1d_cnn.yaml'}", "epochs=3"])
    assert (cnn.model, cnn.epochs, cnn.learning_rate) == (train.Model.cnn, 3, 1e-2)
    paper = config_lib.parse(train.Config, [f"config={CONFIGS / 'mnist1d_cnn_paper.yaml'}"])
    assert (paper.model, paper.learning_rate, paper.weight_decay) == (train.Model.cnn, 1e-2, 0.0)
    assert paper.epochs * (4000 // paper.global_batch_size) == 5986  # the paper's 6000 steps, batch 96 not 100
    with pytest.raises(config_lib.ConfigError, match=r"`model`.*'rnn'"):
        config_lib.parse(train.Config, ["model=rnn"])
    with pytest.raises(config_lib.ConfigError, match=r"Unknown config key `epoch`.*Did you mean `epochs`"):
        config_lib.parse(train.Config, ["epoch=3"])
    with pytest.raises(config_lib.ConfigError, match=r"`epochs`.*expected int"):
        config_lib.parse(train.Config, ["epochs=many"])


@pytest.mark.slow
def test_a_run_resumes_on_4_devices_with_the_optimizer_state_split(tmp_path):
    """The replicated engine on 8 devices saves at step 12 (and at its end, 24); with the end's checkpoint
    removed, as if the run had died after step 12, it resumes on 4 devices with ``shard_optimizer=true``
    (ZeRO-1) and logs the uninterrupted run's steps 13-24 to round-off."""
    overrides = ("epochs=2", "num_samples=1000", "global_batch_size=64", "hidden=64", "log_every=1", "progress=false")
    ckpt = tmp_path / "ckpt"
    whole = run_example(8, tmp_path / "whole", f"checkpoint_dir={ckpt}", "save_every=12", *overrides)
    steps = 800 // 64
    assert [r["step"] for r in whole] == list(range(1, 2 * steps + 1))
    shutil.rmtree(ckpt / str(2 * steps))
    resumed = run_example(4, tmp_path / "resumed", f"checkpoint_dir={ckpt}", "shard_optimizer=true", *overrides)
    assert [r["step"] for r in resumed] == list(range(steps + 1, 2 * steps + 1))
    meta = json.loads((ckpt / str(2 * steps) / "meta" / "metadata").read_text())
    assert meta["devices"] == 4 and meta["padded"]  # saved split: the 10-class bias padded to 12
    for key in ("loss", "grad_norm", "accuracy"):
        np.testing.assert_allclose(
            [r[key] for r in resumed], [r[key] for r in whole[steps:]], rtol=2e-5, atol=1e-6, err_msg=key
        )
