"""Trains an MLP on MNIST-1D with jddp on N (simulated) devices.

MNIST-1D (Greydanus 2020) is generated locally by the ``mnist1d`` package:
40-sample 1-D signals of the digits 0-9, 4000 for training and 1000 for test
by default; nothing is downloaded.

    python -m examples.mnist1d.train devices=8 epochs=30
    jddp launch -n 2 --devices-per-process 4 -m examples.mnist1d.train epochs=30
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
    devices: int = 0  # simulated CPU devices per process (0: $JDDP_LOCAL_DEVICES under jddp launch, else JAX's)
    epochs: int = 30  # passes over the training set
    global_batch_size: int = 128  # examples per step over all devices
    learning_rate: float = 3e-3  # AdamW learning rate
    weight_decay: float = 1e-4  # AdamW weight decay
    hidden: int = 256  # width of the two hidden layers
    num_samples: int = 5000  # MNIST-1D examples generated (80% train, 20% test)
    seed: int = 0  # seeds the data generation, the shuffling and the init
    log_every: int = 5  # print metrics every this many epochs (and the last)


def load_data(config: Config) -> dict[str, np.ndarray]:
    """MNIST-1D arrays: ``x`` [n, 40] float32, ``y`` [n] int32, and ``x_test``, ``y_test``."""
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = config.num_samples, config.seed
    data = make_dataset(args)
    return {
        k: np.asarray(data[k], np.float32 if k.startswith("x") else np.int32) for k in ("x", "y", "x_test", "y_test")
    }


def make_model(config: Config):
    """An NNX MLP as ``(graphdef, params, model_state)``."""
    from flax import nnx

    from jddp import models

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.l1 = nnx.Linear(40, config.hidden, rngs=rngs)
            self.l2 = nnx.Linear(config.hidden, config.hidden, rngs=rngs)
            self.l3 = nnx.Linear(config.hidden, 10, rngs=rngs)

        def __call__(self, x):
            return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))

    return models.nnx_split(MLP(nnx.Rngs(config.seed)))


def classification_metrics(logits, batch):
    import jax.numpy as jnp
    import optax

    import jddp

    mask = batch.get("mask")
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), mask)
    accuracy = jddp.masked_mean((jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32), mask)
    return loss, {"accuracy": accuracy}


def main(config: Config) -> dict[str, float]:
    """Trains and returns the final metrics (train loss, test loss and accuracy)."""
    import jddp

    jddp.initialize(local_devices=config.devices or None)  # joins the group under `jddp launch`
    import jax
    import optax

    from jddp import models

    data = load_data(config)
    mesh = jddp.data_mesh()
    graphdef, params, model_state = make_model(config)
    dp = jddp.DataParallel(
        models.nnx_loss(graphdef, lambda model, batch, rng: classification_metrics(model(batch["x"]), batch)),
        optax.adamw(config.learning_rate, weight_decay=config.weight_decay),
        mesh=mesh,
        eval_fn=models.nnx_eval(graphdef, eval_metrics),
    )
    state = dp.init(params, model_state, rng=config.seed)
    if jddp.is_main_process():
        print(f"jddp {jddp.__version__}: process {jddp.process_index()}/{jddp.process_count()}, "
              f"{jax.device_count()} devices ({jax.local_device_count()} local), "
              f"global batch {config.global_batch_size}")  # fmt: skip

    train_loader = jddp.data.DataLoader(
        {"x": data["x"], "y": data["y"]}, global_batch_size=config.global_batch_size, seed=config.seed
    )
    test_loader = jddp.data.DataLoader(
        {"x": data["x_test"], "y": data["y_test"]},
        global_batch_size=config.global_batch_size,
        shuffle=False,
        drop_last=False,  # every test example once; the padding is masked
    )
    start, steps, result = time.perf_counter(), 0, {}
    for epoch in range(config.epochs):
        for batch in train_loader:
            state, metrics = dp.step(state, batch)
            steps += 1
        if (epoch + 1) % config.log_every == 0 or epoch + 1 == config.epochs:
            test = dp.evaluate(state, test_loader)
            result = {"epoch": epoch + 1, "steps": steps, "train_loss": metrics["loss"],
                      "test_loss": test["loss"], "test_accuracy": test["accuracy"],
                      "seconds": time.perf_counter() - start}  # fmt: skip
            if jddp.is_main_process():
                print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return result


def eval_metrics(model, batch) -> dict:
    loss, metrics = classification_metrics(model(batch["x"]), batch)
    return {"loss": loss, **metrics}


def parse(argv: list[str]) -> Config:
    """``key=value`` overrides on the defaults, checked by OmegaConf (unknown keys and bad types raise)."""
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(argv))
    return OmegaConf.to_object(merged)


if __name__ == "__main__":
    main(parse(sys.argv[1:]))
