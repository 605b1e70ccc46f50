"""A short MNIST-1D run: it learns, and config overrides are checked."""

import dataclasses

import numpy as np
import pytest
from omegaconf.errors import ConfigKeyError, ValidationError

from examples.mnist1d import train


def test_trains_above_chance():
    config = dataclasses.replace(
        train.parse([]), epochs=8, num_samples=1500, log_every=8, hidden=128, learning_rate=1e-2
    )
    result = train.main(config)
    assert result["steps"] == 8 * (1200 // 128)
    assert result["test_accuracy"] > 0.3  # chance is 0.1
    assert np.isfinite(result["train_loss"])


def test_overrides_are_typed_and_checked():
    assert train.parse(["epochs=3", "learning_rate=0.1"]).epochs == 3
    with pytest.raises(ConfigKeyError, match="epoch"):
        train.parse(["epoch=3"])
    with pytest.raises(ValidationError, match="epochs"):
        train.parse(["epochs=many"])
