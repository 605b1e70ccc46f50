"""A short MNIST-1D run per model: it learns, and the config is checked before any JAX work."""

import dataclasses
import math

import pytest

from examples.mnist1d import train
from jddp import config as config_lib

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


def test_configs_load_and_overrides_are_checked():
    assert config_lib.parse(train.Config, [], path=train.DEFAULT_CONFIG).model is train.Model.mlp
    cnn = config_lib.parse(train.Config, [f"config={CONFIGS / 'mnist1d_cnn.yaml'}", "epochs=3"])
    assert (cnn.model, cnn.epochs, cnn.learning_rate) == (train.Model.cnn, 3, 1e-2)
    with pytest.raises(config_lib.ConfigError, match=r"`model`.*'rnn'"):
        config_lib.parse(train.Config, ["model=rnn"])
    with pytest.raises(config_lib.ConfigError, match=r"Unknown config key `epoch`.*Did you mean `epochs`"):
        config_lib.parse(train.Config, ["epoch=3"])
    with pytest.raises(config_lib.ConfigError, match=r"`epochs`.*expected int"):
        config_lib.parse(train.Config, ["epochs=many"])
