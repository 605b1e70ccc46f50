"""Equinox's ``examples/train_rnn.py`` in its shape: a GRU classifying clockwise against anticlockwise spirals, one
``make_step`` under ``eqx.filter_jit`` (``filter_value_and_grad``, ``optax.update``, ``eqx.apply_updates``) and an
endless loader of random batches. ``original.py`` runs on one device, ``train.py`` is its jddp port: ``diff
examples/eqx_rnn_port/original.py examples/eqx_rnn_port/train.py`` is what the port changed.

    JDDP_LOCAL_DEVICES=8 python -m examples.eqx_rnn_port.train --steps 200   # or: jddp launch -n 2 -m ...
"""

from __future__ import annotations

import argparse
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import optax

import jddp


def get_data(dataset_size, *, key):
    """Spirals over 16 time steps; the first half turn the other way (label 0)."""
    t = jnp.linspace(0, 2 * math.pi, 16)
    offset = jrandom.uniform(key, (dataset_size, 1), minval=0, maxval=2 * math.pi)
    x1, x2 = jnp.sin(t + offset) / (1 + t), jnp.cos(t + offset) / (1 + t)
    y = jnp.ones((dataset_size, 1)).at[: dataset_size // 2].set(0)
    x1 = x1.at[: dataset_size // 2].multiply(-1)
    return np.asarray(jnp.stack([x1, x2], axis=-1)), np.asarray(y)


def dataloader(arrays, batch_size, *, key):
    """Endless random batches: a new permutation every pass."""
    size = arrays[0].shape[0]
    indices = np.arange(size)
    while True:
        perm = np.asarray(jrandom.permutation(key, indices))
        (key,) = jrandom.split(key, 1)
        for start in range(0, size - batch_size + 1, batch_size):
            yield tuple(array[perm[start : start + batch_size]] for array in arrays)


class RNN(eqx.Module):
    hidden_size: int
    cell: eqx.Module
    linear: eqx.nn.Linear
    bias: jax.Array

    def __init__(self, in_size, out_size, hidden_size, *, key):
        ckey, lkey = jrandom.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.linear = eqx.nn.Linear(hidden_size, out_size, use_bias=False, key=lkey)
        self.bias = jnp.zeros(out_size)

    def __call__(self, input):
        out, _ = jax.lax.scan(lambda carry, inp: (self.cell(inp, carry), None), jnp.zeros((self.hidden_size,)), input)
        return jax.nn.sigmoid(self.linear(out) + self.bias)


def main(dataset_size=10000, batch_size=32, learning_rate=3e-3, steps=200, hidden_size=16, seed=5678, workdir="x"):
    data_key, _, model_key = jrandom.split(jrandom.PRNGKey(seed), 3)
    xs, ys = get_data(dataset_size, key=data_key)
    loader = jddp.data.DataLoader({"x": xs, "y": ys}, global_batch_size=batch_size, seed=seed)
    iter_data = ((batch["x"], batch["y"]) for _ in iter(int, 1) for batch in loader)  # endless, as the original's

    model = RNN(in_size=2, out_size=1, hidden_size=hidden_size, key=model_key)

    @eqx.filter_value_and_grad
    def compute_loss(model, x, y):
        pred_y = jax.vmap(model)(x)
        return -jnp.mean(y * jnp.log(pred_y) + (1 - y) * jnp.log(1 - pred_y))

    @jddp.data_parallel(batch_argnums=(1, 2))
    def make_step(model, x, y, opt_state):
        loss, grads = compute_loss(model, x, y)
        updates, opt_state = optim.update(grads, opt_state)
        model = eqx.apply_updates(model, updates)
        return jddp.global_mean(loss), model, opt_state

    optim = optax.chain(jddp.average_gradients(), optax.adam(learning_rate))
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    ckpt = jddp.Checkpointer(f"{workdir}/ckpt", save_every=50)
    (model, opt_state), loader = ckpt.restore_or_init((model, opt_state), loader)
    for step, (x, y) in zip(range(ckpt.latest_step() or 0, steps), iter_data, strict=False):
        loss, model, opt_state = make_step(model, x, y, opt_state)
        ckpt.maybe_save((model, opt_state), loader, step=step + 1)
        print(f"step={step}, loss={loss.item()}")
    return model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workdir", default="runs/eqx_rnn")
    args = parser.parse_args()
    jddp.initialize()
    main(steps=args.steps, workdir=args.workdir)
