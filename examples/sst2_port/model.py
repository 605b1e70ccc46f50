"""A text classifier in the shape of Flax's ``examples/sst2`` model (Linen): word dropout, an embedding with dropout,
a bidirectional LSTM over each sentence's real tokens, MLP attention pooling masked by the length, and an MLP head.
Written for jddp's port (``train.py``) and its single-device original (``original.py``); both use it unchanged."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class Embedder(nn.Module):
    """Token ids to vectors; in training, each word is replaced by ``unk_idx`` with ``word_dropout_rate``."""

    vocab_size: int
    embedding_size: int
    dropout_rate: float
    word_dropout_rate: float
    unk_idx: int

    @nn.compact
    def __call__(self, token_ids, deterministic: bool):
        if not deterministic and self.word_dropout_rate > 0:
            dropped = jax.random.bernoulli(self.make_rng("dropout"), self.word_dropout_rate, token_ids.shape)
            token_ids = jnp.where(dropped, self.unk_idx, token_ids)
        x = nn.Embed(self.vocab_size, self.embedding_size)(token_ids)
        return nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)


class BiLSTM(nn.Module):
    hidden_size: int

    @nn.compact
    def __call__(self, x, lengths):
        forward = nn.RNN(nn.OptimizedLSTMCell(self.hidden_size))(x, seq_lengths=lengths)
        backward = nn.RNN(nn.OptimizedLSTMCell(self.hidden_size), reverse=True, keep_order=True)(x, seq_lengths=lengths)
        return jnp.concatenate([forward, backward], axis=-1)


class AttentionPool(nn.Module):
    """MLP attention over the time steps; steps past the sentence's length get no weight."""

    hidden_size: int

    @nn.compact
    def __call__(self, x, lengths):
        scores = nn.Dense(1)(jnp.tanh(nn.Dense(self.hidden_size)(x)))[..., 0]
        real = jnp.arange(x.shape[1])[None, :] < lengths[:, None]
        weights = jax.nn.softmax(jnp.where(real, scores, -1e9), axis=-1)
        return jnp.einsum("bt,bth->bh", weights, x)


class TextClassifier(nn.Module):
    embedding_size: int
    hidden_size: int
    vocab_size: int
    output_size: int
    dropout_rate: float
    word_dropout_rate: float
    unk_idx: int

    @nn.compact
    def __call__(self, token_ids, lengths, deterministic: bool):
        x = Embedder(self.vocab_size, self.embedding_size, self.dropout_rate, self.word_dropout_rate, self.unk_idx)(
            token_ids, deterministic
        )
        x = AttentionPool(self.hidden_size)(BiLSTM(self.hidden_size)(x, lengths), lengths)
        x = nn.Dropout(self.dropout_rate)(nn.relu(nn.Dense(self.hidden_size)(x)), deterministic=deterministic)
        return nn.Dense(self.output_size)(x)
