"""Trains an MLP or a CNN on MNIST-1D with jddp on N (simulated) devices.

MNIST-1D (Greydanus 2020) is generated locally by the ``mnist1d`` package:
40-sample 1-D signals of the digits 0-9, 4000 for training and 1000 for test
by default; nothing is downloaded.

    python -m examples.mnist1d.train devices=8
    python -m examples.mnist1d.train config=configs/mnist1d_cnn.yaml devices=8
    jddp launch -n 2 --devices-per-process 4 -m examples.mnist1d.train
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import sys

import numpy as np

from examples import common
from jddp.config import run_field

DEFAULT_CONFIG = pathlib.Path(__file__).parents[2] / "configs" / "mnist1d_mlp.yaml"


class Model(enum.Enum):
    mlp = "mlp"  # 40 -> hidden -> hidden -> 10, ReLU
    cnn = "cnn"  # three strided 1-D convolutions (length 40 -> 20 -> 10 -> 5) and a linear classifier


@dataclasses.dataclass(frozen=True)
class Config:
    devices: int = run_field(0)  # simulated CPU devices per process (0: $JDDP_LOCAL_DEVICES or JAX's)
    model: Model = Model.mlp  # `mlp` or `cnn`
    epochs: int = 30  # passes over the training set
    global_batch_size: int = 128  # examples per step over all devices
    learning_rate: float = 3e-3  # AdamW learning rate at step 0, cosine decay to 0 at the last step
    weight_decay: float = 1e-4  # AdamW weight decay
    hidden: int = 256  # MLP: width of the two hidden layers
    channels: int = 32  # CNN: channels of each convolution
    num_samples: int = 5000  # MNIST-1D examples generated (80% train, 20% test)
    seed: int = 0  # seeds the data generation, the shuffling and the init
    eval_every: int = 0  # steps between test evaluations (0: after every epoch); always at the end
    log_every: int = run_field(10)  # steps between train-metric records
    log_dir: str = run_field("runs/mnist1d")  # metrics.jsonl, TensorBoard events, config.yaml, loss.png ("" for none)
    checkpoint_dir: str = run_field("")  # checkpoints, resumed from when present ("" for none)
    save_every: int = run_field(0)  # steps between checkpoints (0: only at the end)
    progress: bool = run_field(True)  # progress bar on process 0
    shard_optimizer: bool = run_field(False)  # ZeRO-1: AdamW state split over the devices (a run may switch)
    compute_dtype: str = "float32"  # the forward and backward pass: float32, bfloat16 or float16 (mixed precision)


def load_data(config: Config) -> dict[str, np.ndarray]:
    """MNIST-1D arrays: ``x`` [n, 40] float32, ``y`` [n] int32, and ``x_test``, ``y_test``.

    Generating them takes seconds, on every process of every restart; the arrays are kept in
    ``$XDG_CACHE_HOME/jddp/data`` (``~/.cache/jddp/data``), keyed by the generator's version, the sample count and
    the seed, written atomically (a process killed while writing leaves nothing half written).
    """
    from importlib.metadata import version

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = pathlib.Path(base) / "jddp" / "data" / f"mnist1d-{version('mnist1d')}-{config.num_samples}-{config.seed}.npz"
    try:
        with np.load(path) as cached:
            return {k: cached[k] for k in ("x", "y", "x_test", "y_test")}
    except (OSError, KeyError, ValueError):
        pass  # not there yet, or unreadable: generate it again
    from mnist1d.data import get_dataset_args, make_dataset  # imports SciPy and Matplotlib: seconds, when needed only

    args = get_dataset_args()
    args.num_samples, args.seed = config.num_samples, config.seed
    data = make_dataset(args)
    arrays = {
        k: np.asarray(data[k], np.float32 if k.startswith("x") else np.int32) for k in ("x", "y", "x_test", "y_test")
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: generate it every time
    return arrays


def make_model(config: Config):
    """The NNX model named by ``config.model`` as ``(graphdef, params, model_state)``."""
    from flax import nnx

    from jddp import models

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(40, config.hidden, rngs=rngs)
            self.l2 = nnx.Linear(config.hidden, config.hidden, rngs=rngs)
            self.l3 = nnx.Linear(config.hidden, 10, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    class CNN(nnx.Module):
        """The MNIST-1D paper's CNN: signal length 40 -> 20 -> 10 -> 5, then a linear classifier."""

        def __init__(self, rngs: nnx.Rngs):
            c = config.channels
            self.c1 = nnx.Conv(1, c, kernel_size=(5,), strides=(2,), padding=2, rngs=rngs)
            self.c2 = nnx.Conv(c, c, kernel_size=(3,), strides=(2,), padding=1, rngs=rngs)
            self.c3 = nnx.Conv(c, c, kernel_size=(3,), strides=(2,), padding=1, rngs=rngs)
            self.out = nnx.Linear(5 * c, 10, rngs=rngs)

        def __call__(self, x):
            h = x[:, :, None]  # [batch, length, 1 channel]
            h = nnx.relu(self.c3(nnx.relu(self.c2(nnx.relu(self.c1(h))))))
            return self.out(h.reshape(h.shape[0], -1))

    model = {Model.mlp: MLP, Model.cnn: CNN}[config.model]
    return models.nnx_split(model(nnx.Rngs(config.seed)))


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
