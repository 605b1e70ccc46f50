"""Trains a small CNN with synchronised BatchNorm on scikit-learn's digits.

The data ships with scikit-learn (``sklearn.datasets.load_digits``: 1797 8x8
grey-level images of the digits 0-9, 16 levels); nothing is downloaded. A
stratified split keeps 20% (360 images) for test. BatchNorm statistics are
computed over the whole global batch, across devices and processes
(``nnx.BatchNorm(..., axis_name="data")``, PyTorch's SyncBatchNorm), so a run
on 8 devices normalises exactly as one device would; the test metrics use the
running averages (eval mode, ``jddp.models.nnx_eval``).

    python -m examples.digits.train devices=8
    jddp launch -n 2 --devices-per-process 4 -m examples.digits.train
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys

import numpy as np

from examples import common
from jddp.config import run_field

DEFAULT_CONFIG = pathlib.Path(__file__).parents[2] / "configs" / "digits.yaml"


@dataclasses.dataclass(frozen=True)
class Config:
    devices: int = run_field(0)  # simulated CPU devices per process (0: $JDDP_LOCAL_DEVICES or JAX's)
    epochs: int = 30  # passes over the training set
    global_batch_size: int = 128  # examples per step over all devices
    learning_rate: float = 3e-3  # AdamW learning rate at step 0, cosine decay to 0 at the last step
    weight_decay: float = 1e-4  # AdamW weight decay
    channels: int = 32  # channels of the first convolution; the second and third have 2x
    momentum: float = 0.9  # BatchNorm running-average momentum
    test_fraction: float = 0.2  # share of the 1797 images held out (stratified by digit)
    seed: int = 0  # seeds the split, the shuffling and the init
    eval_every: int = 0  # steps between test evaluations (0: after every epoch); always at the end
    log_every: int = run_field(10)  # steps between train-metric records
    log_dir: str = run_field("runs/digits")  # metrics.jsonl, TensorBoard events, config.yaml, loss.png ("" for none)
    checkpoint_dir: str = run_field("")  # checkpoints, resumed from when present ("" for none)
    save_every: int = run_field(0)  # steps between checkpoints (0: only at the end)
    progress: bool = run_field(True)  # progress bar on process 0
    shard_optimizer: bool = run_field(False)  # ZeRO-1: AdamW state split over the devices (a run may switch)
    compute_dtype: str = "float32"  # the forward and backward pass: float32, bfloat16 or float16 (mixed precision)


def load_data(config: Config) -> dict[str, np.ndarray]:
    """Digits as ``x`` [n, 8, 8, 1] float32 in [0, 1], ``y`` [n] int32, and ``x_test``, ``y_test``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    x, x_test, y, y_test = train_test_split(x, y, test_size=config.test_fraction, random_state=config.seed, stratify=y)
    return {"x": x, "y": y, "x_test": x_test, "y_test": y_test}


def make_model(config: Config):
    """The CNN as ``(graphdef, params, model_state)``; ``model_state`` holds the BatchNorm statistics."""
    from flax import nnx

    import jddp
    from jddp import models

    def block(c_in: int, c_out: int, rngs: nnx.Rngs) -> nnx.Sequential:
        # No bias before BatchNorm: its shift makes one redundant.
        conv = nnx.Conv(c_in, c_out, kernel_size=(3, 3), padding="SAME", use_bias=False, rngs=rngs)
        norm = nnx.BatchNorm(c_out, momentum=config.momentum, axis_name=jddp.DATA_AXIS, rngs=rngs)
        return nnx.Sequential(conv, norm, nnx.relu)

    class CNN(nnx.Module):
        """8x8 -> conv-BN-ReLU -> conv-BN-ReLU -> 2x2 max pool -> conv-BN-ReLU -> mean over 4x4 -> linear."""

        def __init__(self, rngs: nnx.Rngs):
            c = config.channels
            self.b1 = block(1, c, rngs)
            self.b2 = block(c, 2 * c, rngs)
            self.b3 = block(2 * c, 2 * c, rngs)
            self.out = nnx.Linear(2 * c, 10, rngs=rngs)

        def __call__(self, x):
            h = self.b2(self.b1(x))
            h = nnx.max_pool(h, window_shape=(2, 2), strides=(2, 2))
            h = self.b3(h).mean(axis=(1, 2))
            return self.out(h)

    return models.nnx_split(CNN(nnx.Rngs(config.seed)))


def main(config: Config) -> dict[str, float]:
    """Trains and returns the final metrics (steps, train loss, test loss and accuracy, timings)."""
    import jddp

    jddp.initialize(local_devices=config.devices or None)  # joins the group under `jddp launch`
    result = common.train_classifier(config, load_data(config), make_model(config))
    common.report(result)
    return result


if __name__ == "__main__":
    from jddp import config as config_lib

    main(config_lib.parse(Config, sys.argv[1:], path=DEFAULT_CONFIG))
