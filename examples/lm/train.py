"""Trains a small byte-level Transformer language model on the Python standard library's source.

The corpus ships with every Python (``examples/lm/data.py``): the top-level
modules of the standard library, whole files held out for test. The model
(``examples/lm/model.py``) keeps float32 parameters and computes in bfloat16;
the loss is float32, a ``jddp.Weighted`` sum over the real target bytes, so the
reported loss and the test perplexity are exact per-byte means however the
windows fall on devices.

    python -m examples.lm.train devices=8
    jddp launch -n 2 --devices-per-process 4 -m examples.lm.train
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sys

from examples import common
from examples.lm import data as data_lib
from jddp.config import run_field

DEFAULT_CONFIG = pathlib.Path(__file__).parents[2] / "configs" / "lm.yaml"


@dataclasses.dataclass(frozen=True)
class Config:
    devices: int = run_field(0)  # simulated CPU devices per process (0: $JDDP_LOCAL_DEVICES or JAX's)
    steps: int = 300  # optimizer steps (the training split is 65k windows: 300 steps of 32 see 15% of it)
    global_batch_size: int = 32  # windows per step over all devices
    seq_len: int = 64  # bytes predicted per window (the context)
    d_model: int = 64  # width of the residual stream
    heads: int = 4  # attention heads
    layers: int = 2  # Transformer blocks
    mlp_ratio: int = 4  # MLP width / d_model
    learning_rate: float = 3e-3  # AdamW peak learning rate (linear warmup, cosine decay to 0)
    warmup_steps: int = 30  # steps of linear warmup
    weight_decay: float = 0.01  # AdamW weight decay
    clip_grad_norm: float = 1.0  # global norm of the averaged gradient
    compute_dtype: str = "bfloat16"  # dtype of the forward pass (`float32` to compare); parameters stay float32
    corpus_dir: str = ""  # a directory of .py files to train on ("": this Python's standard library)
    test_modulus: int = 10  # a file is held out when crc32(name) % test_modulus == 0
    eval_batch_size: int = 256  # windows per evaluation step
    seed: int = 0  # seeds the shuffling and the init
    eval_every: int = 0  # steps between test evaluations (0: at each epoch's end); always at the end
    log_every: int = run_field(10)  # steps between train-metric records
    log_dir: str = run_field("runs/lm")  # metrics.jsonl, TensorBoard events, config.yaml, loss.png ("" for none)
    checkpoint_dir: str = run_field("")  # checkpoints, resumed from when present ("" for none)
    save_every: int = run_field(0)  # steps between checkpoints (0: only at the end)
    progress: bool = run_field(True)  # progress bar on process 0
    shard_optimizer: bool = run_field(False)  # ZeRO-1: AdamW state split over the devices (a run may switch)

    def __post_init__(self):
        if self.compute_dtype not in ("bfloat16", "float32"):
            raise ValueError(
                f"`compute_dtype` must be 'bfloat16' or 'float32', got compute_dtype={self.compute_dtype!r}."
            )
        if self.corpus_dir and not pathlib.Path(self.corpus_dir).is_dir():
            raise ValueError(
                f"`corpus_dir` must be a directory of .py files, got corpus_dir={self.corpus_dir!r}, which is not "
                "a directory; give an existing one, or '' for the standard library."
            )
        if self.d_model % self.heads:
            raise ValueError(
                f"`d_model` must be divisible by `heads`, got d_model={self.d_model}, heads={self.heads}; "
                f"e.g. heads={math.gcd(self.d_model, 4)}."
            )


def language_model_metrics(logits, batch) -> tuple:
    """Per-byte cross-entropy and next-byte accuracy as ``jddp.Weighted`` sums over the real targets.

    Args:
      logits: float32 ``[batch, seq_len, 256]``.
      batch: ``tokens`` ``[batch, seq_len + 1]``, ``weights`` ``[batch, seq_len]`` and the
        loader's per-window ``mask`` (0 for padded windows).

    Returns:
      ``(loss, {"accuracy": accuracy})``.
    """
    import jax.numpy as jnp
    import optax

    import jddp

    targets = batch["tokens"][:, 1:].astype(jnp.int32)
    weights = batch["weights"]
    if "mask" in batch:  # padded windows of the loader's last batch
        weights = weights * batch["mask"][:, None]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    count = jnp.sum(weights)
    return jddp.Weighted(jnp.sum(losses * weights), count), {
        "accuracy": jddp.Weighted(jnp.sum(correct * weights), count)
    }


def make_model(config: Config):
    """The Transformer as ``(graphdef, params, model_state)``."""
    import jax.numpy as jnp
    from flax import nnx

    from examples.lm import model
    from jddp import models

    transformer = model.Transformer(
        seq_len=config.seq_len,
        d_model=config.d_model,
        heads=config.heads,
        layers=config.layers,
        mlp_ratio=config.mlp_ratio,
        dtype=jnp.dtype(config.compute_dtype),
        rngs=nnx.Rngs(config.seed),
    )
    return models.nnx_split(transformer)


def forward(model, batch):
    """Next-byte logits for the inputs ``tokens[:, :-1]`` of a batch of windows."""
    return model(batch["tokens"][:, :-1].astype("int32"))


def eval_metrics(model, batch) -> dict:
    """``eval_fn`` body for ``jddp.models.nnx_eval``: per-byte loss and accuracy."""
    loss, metrics = language_model_metrics(forward(model, batch), batch)
    return {"loss": loss, **metrics}


def main(config: Config) -> dict[str, float]:
    """Trains and returns the final metrics (steps, train loss, test loss, perplexity, bits per byte, timings)."""
    import jddp

    jddp.initialize(local_devices=config.devices or None)  # joins the group under `jddp launch`
    import optax

    from jddp import models

    root = pathlib.Path(config.corpus_dir) if config.corpus_dir else None
    corpus = data_lib.load(config.seq_len, test_modulus=config.test_modulus, root=root)
    graphdef, params, model_state = make_model(config)

    if config.steps <= config.warmup_steps:
        raise ValueError(
            f"`steps` must be more than `warmup_steps` (the cosine decay follows the warmup), got "
            f"steps={config.steps}, warmup_steps={config.warmup_steps}; lower warmup_steps or raise steps."
        )
    schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, config.warmup_steps, config.steps)
    dp = jddp.DataParallel(
        models.nnx_loss(graphdef, lambda model, batch, rng: language_model_metrics(forward(model, batch), batch)),
        optax.adamw(schedule, weight_decay=config.weight_decay),
        mesh=jddp.data_mesh(),
        clip_grad_norm=config.clip_grad_norm,
        eval_fn=models.nnx_eval(graphdef, eval_metrics),
        shard_optimizer=config.shard_optimizer,
    )
    state = dp.init(params, model_state, rng=config.seed)
    train_loader = jddp.data.DataLoader(corpus["train"], global_batch_size=config.global_batch_size, seed=config.seed)
    test_loader = jddp.data.DataLoader(
        corpus["test"], global_batch_size=config.eval_batch_size, shuffle=False, drop_last=False
    )
    result = common.train(dp, state, train_loader, test_loader, config, steps=config.steps)
    result["test_perplexity"] = math.exp(result["test_loss"])
    result["test_bits_per_byte"] = result["test_loss"] / math.log(2)
    result["test_bytes"] = int(corpus["test"]["weights"].sum())
    common.report(result)
    return result


if __name__ == "__main__":
    from jddp import config as config_lib

    main(config_lib.parse(Config, sys.argv[1:], path=DEFAULT_CONFIG))
