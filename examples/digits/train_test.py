"""A short digits run: it learns with synchronised BatchNorm, and the config is checked."""

import dataclasses
import math

import numpy as np
import pytest

from examples.digits import train
from jddp import config as config_lib


@pytest.mark.slow  # seconds of compiling and training: the full tier
def test_trains_well_above_chance(tmp_path):
    config = config_lib.parse(train.Config, [], path=train.DEFAULT_CONFIG)
    config = dataclasses.replace(config, epochs=3, channels=8, learning_rate=1e-2, log_dir=str(tmp_path),
                                 progress=False)  # fmt: skip
    result = train.main(config)
    assert result["steps"] == 3 * (1437 // 128)
    assert result["train_loss"] < 0.6 * math.log(10)  # 2.39 at step 1
    assert result["test_accuracy"] > 0.6  # chance is 0.1; eval mode uses the running statistics


def test_split_is_stratified_and_disjoint():
    data = train.load_data(train.Config())
    assert data["x"].shape == (1437, 8, 8, 1) and data["x_test"].shape == (360, 8, 8, 1)
    assert 0.0 <= data["x"].min() and data["x"].max() <= 1.0
    assert np.bincount(data["y_test"]).min() >= 35  # about 36 of each digit
    train_rows = {row.tobytes() for row in data["x"]}
    overlap = sum(row.tobytes() in train_rows for row in data["x_test"])
    assert overlap <= 2  # digits holds a few identical images under different indices


def test_config_is_checked():
    assert config_lib.parse(train.Config, [], path=train.DEFAULT_CONFIG).epochs == 20
    with pytest.raises(config_lib.ConfigError, match="Unknown config key `chanels`"):
        config_lib.parse(train.Config, ["chanels=8"])
    with pytest.raises(config_lib.ConfigError, match=r"`momentum`.*expected float"):
        config_lib.parse(train.Config, ["momentum=high"])
