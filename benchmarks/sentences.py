"""The bucketing benchmark's data and model: SST-2-like sentence lengths and a small bidirectional RNN classifier.

Lengths follow SST-2's sentences (GLUE SST-2 train: most under 30 tokens, a long tail to about 60): a log-normal
around 13 tokens, clipped to ``[1, max_len]``. The model embeds tokens, runs a tanh RNN forward and backward over
each sentence's real tokens (padding leaves the carry unchanged) and classifies the two final states.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PAD = 0  # token id of padding; real tokens are 1..vocab-1


def sentences(n: int, *, max_len: int = 60, vocab: int = 2000, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` synthetic sentences stored padded to ``max_len``: ``tokens``, ``length`` and a label ``y`` that
    depends on the tokens (the share of even token ids)."""
    rng = np.random.default_rng(seed)
    length = np.clip(np.rint(rng.lognormal(np.log(13.0), 0.6, n)), 1, max_len).astype(np.int32)
    tokens = rng.integers(1, vocab, (n, max_len)).astype(np.int32)
    tokens[np.arange(max_len)[None, :] >= length[:, None]] = PAD
    even = ((tokens % 2 == 0) & (tokens != PAD)).sum(1) / length
    return {"tokens": tokens, "length": length, "y": (even > 0.5).astype(np.int32)}


def init(*, vocab: int = 2000, dim: int = 64, hidden: int = 128, seed: int = 0) -> dict[str, np.ndarray]:
    """The parameters of ``logits``, as NumPy arrays."""
    rng = np.random.default_rng(seed)

    def dense(i: int, o: int) -> np.ndarray:
        return (rng.normal(size=(i, o)) / np.sqrt(i)).astype(np.float32)

    params = {"embed": dense(vocab, dim) * np.sqrt(vocab) * 0.1, "out": dense(2 * hidden, 2)}
    for d in ("fwd", "bwd"):
        params |= {
            f"{d}_x": dense(dim, hidden),
            f"{d}_h": dense(hidden, hidden),
            f"{d}_b": np.zeros(hidden, np.float32),
        }
    return params


def _run(params, prefix: str, x: jax.Array, valid: jax.Array) -> jax.Array:
    """A tanh RNN over the time axis of ``x`` ([batch, time, dim]); where ``valid`` is False the carry stays."""
    h0 = jnp.zeros((x.shape[0], params[f"{prefix}_h"].shape[0]), x.dtype) * x[:, :1, :1].sum()  # batch-dependent

    def cell(h, inputs):
        xt, vt = inputs
        new = jnp.tanh(xt @ params[f"{prefix}_x"] + h @ params[f"{prefix}_h"] + params[f"{prefix}_b"])
        return jnp.where(vt[:, None], new, h), None

    h, _ = jax.lax.scan(cell, h0, (jnp.swapaxes(x, 0, 1), jnp.swapaxes(valid, 0, 1)))
    return h


def logits(params, tokens: jax.Array, length: jax.Array) -> jax.Array:
    """``float32[batch, 2]`` from ``tokens`` ([batch, time], padded anywhere past ``length``)."""
    x = params["embed"][tokens]
    valid = jnp.arange(tokens.shape[1])[None, :] < length[:, None]
    forward = _run(params, "fwd", x, valid)
    backward = _run(params, "bwd", x[:, ::-1], valid[:, ::-1])  # the padding comes first, the carry waits
    return jnp.concatenate([forward, backward], -1) @ params["out"]
