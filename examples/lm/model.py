"""A small decoder-only Transformer (GPT-style, pre-LayerNorm) in Flax NNX.

Parameters are float32; the forward pass computes in bfloat16: every
``Linear`` and ``Embed`` casts its float32 parameters and its input to
``dtype`` (Flax's ``promote_dtype``), LayerNorm takes its statistics in
float32 and returns ``dtype``, and the attention softmax runs in float32. The
logits come back as float32, so the loss is computed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB = 256  # bytes


class Block(nnx.Module):
    """Causal self-attention and an MLP, each behind a LayerNorm and a residual."""

    def __init__(self, d_model: int, heads: int, mlp_ratio: int, *, dtype, rngs: nnx.Rngs):
        if d_model % heads:
            raise ValueError(f"`d_model` must be divisible by `heads`, got d_model={d_model}, heads={heads}.")
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

    def __init__(
        self,
        *,
        seq_len: int,
        d_model: int,
        heads: int,
        layers: int,
        mlp_ratio: int = 4,
        dtype=jnp.bfloat16,
        rngs: nnx.Rngs,
    ):
        embed = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.tokens = nnx.Embed(VOCAB, d_model, **embed)
        self.positions = nnx.Embed(seq_len, d_model, **embed)
        self.blocks = nnx.List([Block(d_model, heads, mlp_ratio, dtype=dtype, rngs=rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d_model, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.head = nnx.Linear(d_model, VOCAB, use_bias=False, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)).astype(jnp.float32)
