"""The LM example's model and corpus, as the snapshot benchmarks train it (a copy of ``examples/lm``'s defaults).

A byte-level decoder-only Transformer (pre-LayerNorm, float32 parameters, bfloat16 compute) on the Python standard
library's top-level modules, with the example's default configuration (``examples/lm/train.py``, ``Config``): the
benchmarks keep their models in modules of their own, never import the examples. ``setup(mesh)`` gives the
``DataParallel``, its state and 8 training batches from the loader, staged on the devices.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import sysconfig
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jddp

VOCAB = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Config:
    """``examples/lm/train.py``'s defaults, the fields the benchmarks read."""

    global_batch_size: int = 32
    seq_len: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    mlp_ratio: int = 4
    learning_rate: float = 3e-3
    weight_decay: float = 0.01
    clip_grad_norm: float = 1.0
    test_modulus: int = 10
    seed: int = 0


class Block(nnx.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm and a residual."""

    def __init__(self, d_model: int, heads: int, mlp_ratio: int, *, dtype, rngs: nnx.Rngs):
        self.heads = heads
        dense = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.ln1 = nnx.LayerNorm(d_model, **dense)
        self.qkv = nnx.Linear(d_model, 3 * d_model, use_bias=False, **dense)
        self.proj = nnx.Linear(d_model, d_model, use_bias=False, **dense)
        self.ln2 = nnx.LayerNorm(d_model, **dense)
        self.up = nnx.Linear(d_model, mlp_ratio * d_model, **dense)
        self.down = nnx.Linear(mlp_ratio * d_model, d_model, **dense)

    def attention(self, x: jax.Array) -> jax.Array:
        batch, length, d = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(batch, length, 3 * self.heads, d // self.heads), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((length, length), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(x.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, length, d)
        return self.proj(out)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.ln1(x))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class Transformer(nnx.Module):
    """Bytes ``[batch, length]`` to float32 next-byte logits ``[batch, length, 256]``."""

    def __init__(self, config: Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        embed = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.tokens = nnx.Embed(VOCAB, config.d_model, **embed)
        self.positions = nnx.Embed(config.seq_len, config.d_model, **embed)
        d, heads, ratio = config.d_model, config.heads, config.mlp_ratio
        self.blocks = nnx.List([Block(d, heads, ratio, dtype=dtype, rngs=rngs) for _ in range(config.layers)])
        self.ln = nnx.LayerNorm(config.d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.head = nnx.Linear(config.d_model, VOCAB, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).astype(jnp.float32)


def loss(model: nnx.Module, batch: dict, rng: jax.Array) -> tuple:
    """Per-byte cross-entropy and next-byte accuracy as ``jddp.Weighted`` sums over the real targets."""
    logits = model(batch["tokens"][:, :-1].astype("int32"))
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


def windows(docs: list[bytes], seq_len: int) -> dict[str, np.ndarray]:
    """Every document cut into windows of ``seq_len + 1`` bytes overlapping by one, the padding weighted 0."""
    rows, weights = [], []
    for doc in docs:
        data = np.frombuffer(doc, np.uint8)
        for start in range(0, len(data) - 1, seq_len):
            chunk = data[start : start + seq_len + 1]
            row = np.zeros(seq_len + 1, np.uint8)
            row[: len(chunk)] = chunk
            w = np.zeros(seq_len, np.float32)
            w[: len(chunk) - 1] = 1.0
            rows.append(row)
            weights.append(w)
    return {"tokens": np.stack(rows), "weights": np.stack(weights)}


def train_windows(config: Config) -> dict[str, np.ndarray]:
    """The training split: the standard library's top-level modules whose name's CRC-32 is not 0 mod
    ``test_modulus``, as windows."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = [p.read_bytes() for p in sorted(root.glob("*.py")) if zlib.crc32(p.name.encode()) % config.test_modulus]
    return windows(docs, config.seq_len)


def setup(mesh: jax.sharding.Mesh, config: Config | None = None) -> tuple[jddp.DataParallel, object, list]:
    """The LM's ``DataParallel``, its state and 8 of its training batches from the loader, staged on the devices."""
    config = config or Config()
    graphdef, params, model_state = jddp.models.nnx_split(Transformer(config, rngs=nnx.Rngs(config.seed)))
    dp = jddp.DataParallel(
        jddp.models.nnx_loss(graphdef, loss),
        optax.adamw(config.learning_rate, weight_decay=config.weight_decay),
        mesh=mesh,
        clip_grad_norm=config.clip_grad_norm,
    )
    state = dp.init(params, model_state, rng=config.seed)
    loader = jddp.data.DataLoader(train_windows(config), global_batch_size=config.global_batch_size, seed=config.seed)
    batches = [jax.block_until_ready(b) for b in itertools.islice(iter(loader), 8)]
    return dp, state, batches
