"""SST-2 sentiment classification in the shape of Flax's ``examples/sst2/train.py`` (a ``TrainState`` with
``apply_gradients``, jitted ``train_step``/``eval_step``, metrics summed per batch, sentences bucketed by length), on
a synthetic stand-in for SST-2 (``input_pipeline.py``). ``original.py`` runs on one device, ``train.py`` is its jddp
port: ``diff examples/sst2_port/original.py examples/sst2_port/train.py`` is what the port changed.

    python -m examples.sst2_port.original --epochs 2                       # one device
    JDDP_LOCAL_DEVICES=8 python -m examples.sst2_port.train --epochs 2  # jddp launch -n 2 -m examples.sst2_port.train
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from flax.training import train_state

from examples.sst2_port import input_pipeline
from examples.sst2_port import model as models

TrainState = train_state.TrainState


@dataclasses.dataclass
class Config:
    learning_rate: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 3e-6
    batch_size: int = 64
    bucket_size: int = 8
    max_input_length: int = 64
    num_epochs: int = 3
    train_size: int = 4096
    eval_size: int = 512
    seed: int = 0
    embedding_size: int = 32
    hidden_size: int = 32
    output_size: int = 1
    dropout_rate: float = 0.2  # Flax: 0.5; on this small synthetic set 0.2 learns within a few epochs
    word_dropout_rate: float = 0.1
    unk_idx: int = input_pipeline.UNK
    vocab_size: int = input_pipeline.VOCAB_SIZE


class Metrics(struct.PyTreeNode):
    loss: jax.Array
    accuracy: jax.Array
    count: Any = None


def sigmoid_cross_entropy_with_logits(*, labels, logits):
    return jnp.maximum(logits, 0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits)))


def get_initial_params(rng, model):
    token_ids, lengths = jnp.ones((2, 3), jnp.int32), jnp.ones((2,), jnp.int32)
    return model.init(rng, token_ids, lengths, deterministic=True)["params"]


def create_train_state(rng, config: Config, model):
    tx = optax.chain(
        optax.sgd(learning_rate=config.learning_rate, momentum=config.momentum),
        optax.add_decayed_weights(weight_decay=config.weight_decay),
    )
    return TrainState.create(apply_fn=model.apply, params=get_initial_params(rng, model), tx=tx)


def compute_metrics(*, labels, logits):
    """Sums over the batch, and its count: normalised per epoch."""
    labels = labels[:, None] if labels.ndim == 1 else labels
    loss = sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)
    correct = jnp.equal(logits >= 0.0, labels)
    return Metrics(loss=jnp.sum(loss), accuracy=jnp.sum(correct), count=logits.shape[0])


def model_from_config(config: Config):
    return models.TextClassifier(
        embedding_size=config.embedding_size,
        hidden_size=config.hidden_size,
        vocab_size=config.vocab_size,
        output_size=config.output_size,
        dropout_rate=config.dropout_rate,
        word_dropout_rate=config.word_dropout_rate,
        unk_idx=config.unk_idx,
    )


def train_step(state: TrainState, batch: dict, rngs: dict) -> tuple[TrainState, Metrics]:
    rngs = {name: jax.random.fold_in(rng, state.step) for name, rng in rngs.items()}

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["token_ids"], batch["length"], deterministic=False, rngs=rngs)
        labels = batch["label"][:, None]
        return jnp.mean(sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)), logits

    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads)
    return new_state, compute_metrics(labels=batch["label"], logits=logits)


def eval_step(state: TrainState, batch: dict) -> Metrics:
    logits = state.apply_fn({"params": state.params}, batch["token_ids"], batch["length"], deterministic=True)
    return compute_metrics(labels=batch["label"], logits=logits)


def normalize_batch_metrics(batch_metrics) -> Metrics:
    total = np.sum([m.count for m in batch_metrics])
    loss = np.sum([m.loss for m in batch_metrics]) / total
    return Metrics(loss=loss, accuracy=np.sum([m.accuracy for m in batch_metrics]) / total)


def evaluate_model(eval_step_fn, state, batches, epoch: int) -> Metrics:
    batch_metrics = [eval_step_fn(state, batch) for batch in batches]
    metrics = normalize_batch_metrics(jax.device_get(batch_metrics))
    print(f"eval  epoch {epoch:03d} loss {metrics.loss:.4f} accuracy {metrics.accuracy * 100:.2f}")
    return metrics


def train_epoch(train_step_fn, state, train_batches, epoch: int, rngs: dict):
    batch_metrics = []
    for batch in train_batches:
        state, metrics = train_step_fn(state, batch, rngs)
        batch_metrics.append(metrics)
    metrics = normalize_batch_metrics(jax.device_get(batch_metrics))
    print(f"train epoch {epoch:03d} loss {metrics.loss:.4f} accuracy {metrics.accuracy * 100:.2f}")
    return state, metrics


def train_and_evaluate(config: Config, workdir: str) -> TrainState:
    train_dataset = input_pipeline.TextDataset(split="train", seed=config.seed, size=config.train_size)
    eval_dataset = input_pipeline.TextDataset(split="validation", seed=config.seed, size=config.eval_size)
    train_batches = train_dataset.get_bucketed_batches(
        config.batch_size,
        config.bucket_size,
        max_input_length=config.max_input_length,
        drop_remainder=True,
        shuffle=True,
        shuffle_seed=config.seed,
    )
    eval_batches = list(eval_dataset.get_batches(batch_size=config.batch_size))
    config.vocab_size = len(train_dataset.vocab)

    train_step_fn = jax.jit(train_step)
    eval_step_fn = jax.jit(eval_step)

    rng = jax.random.key(config.seed)
    state = create_train_state(rng, config, model_from_config(config))

    for epoch in range(1, config.num_epochs + 1):
        rng, epoch_rng = jax.random.split(rng)
        state, _ = train_epoch(train_step_fn, state, train_batches, epoch, {"dropout": epoch_rng})
        evaluate_model(eval_step_fn, state, eval_batches, epoch)
    return state


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=Config.num_epochs)
    parser.add_argument("--workdir", default="runs/sst2")
    parser.add_argument("--train-size", type=int, default=Config.train_size, help="sentences in the training set")
    parser.add_argument("--eval-size", type=int, default=Config.eval_size, help="sentences in the validation set")
    parser.add_argument("--bucket-size", type=int, default=Config.bucket_size, help="the buckets' width in tokens")
    args = parser.parse_args(argv)
    train_and_evaluate(
        Config(
            num_epochs=args.epochs, train_size=args.train_size, eval_size=args.eval_size, bucket_size=args.bucket_size
        ),
        args.workdir,
    )


if __name__ == "__main__":
    main()
