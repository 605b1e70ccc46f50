"""A synthetic stand-in for SST-2 behind the interface of Flax's ``examples/sst2`` input pipeline (``TextDataset``
with ``get_bucketed_batches`` and ``get_batches``), generated here (no download): sentences whose lengths follow
SST-2's shape (a median near 20 tokens, a tail to 60) and whose label is whether they hold more words of a positive
set than of a negative one. ``arrays`` is the same data for ``jddp.data.DataLoader``."""

from __future__ import annotations

import numpy as np

PAD, UNK = 0, 1
MAX_LENGTH = 64
VOCAB_SIZE = 256
_POSITIVE, _NEGATIVE = range(2, 60), range(60, 118)


class TextDataset:
    """``split`` "train" (4096 sentences) or "validation" (512)."""

    def __init__(self, split: str = "train", seed: int = 0, size: int | None = None):
        n = size or {"train": 4096, "validation": 512}[split]
        rng = np.random.default_rng([seed, {"train": 0, "validation": 1}[split]])
        lengths = np.clip(np.round(rng.lognormal(np.log(18), 0.5, n)), 3, 60).astype(np.int32)
        tokens = np.full((n, MAX_LENGTH), PAD, np.int32)
        labels = np.zeros(n, np.float32)
        for i, length in enumerate(lengths):
            words = rng.integers(2, VOCAB_SIZE, length)
            tokens[i, :length] = words
            positive, negative = np.isin(words, _POSITIVE).sum(), np.isin(words, _NEGATIVE).sum()
            labels[i] = float(positive > negative or (positive == negative and rng.random() < 0.5))
        self.arrays = {"token_ids": tokens, "length": lengths, "label": labels}
        self.vocab = range(VOCAB_SIZE)

    def __len__(self) -> int:
        return len(self.arrays["length"])

    def _batch(self, index: np.ndarray, width: int) -> dict:
        return {
            "token_ids": self.arrays["token_ids"][index, :width],
            "length": self.arrays["length"][index],
            "label": self.arrays["label"][index],
        }

    def get_bucketed_batches(self, batch_size, bucket_size, max_input_length, drop_remainder, shuffle, shuffle_seed):
        """An iterable of batches, re-shuffled at each pass: each batch holds sentences of one bucket
        (lengths in ``(b - bucket_size, b]``), padded to ``b``."""
        return _Bucketed(self, batch_size, bucket_size, max_input_length, drop_remainder, shuffle, shuffle_seed)

    def get_batches(self, batch_size: int):
        """Batches in order, each padded to its longest sentence; the last one may be smaller."""
        for start in range(0, len(self), batch_size):
            index = np.arange(start, min(start + batch_size, len(self)))
            yield self._batch(index, int(self.arrays["length"][index].max()))


class _Bucketed:
    def __init__(self, data, batch_size, bucket_size, max_input_length, drop_remainder, shuffle, seed):
        self.data, self.batch_size, self.drop_remainder, self.shuffle = data, batch_size, drop_remainder, shuffle
        self.boundaries = np.arange(bucket_size, max_input_length + 1, bucket_size)
        self.rng, self.epoch = np.random.default_rng(seed), 0

    def __iter__(self):
        lengths = self.data.arrays["length"]
        order = self.rng.permutation(len(lengths)) if self.shuffle else np.arange(len(lengths))
        buckets: dict[int, list[int]] = {}
        for i in order:
            b = int(np.searchsorted(self.boundaries, lengths[i]))
            buckets.setdefault(b, []).append(int(i))
            if len(buckets[b]) == self.batch_size:
                yield self.data._batch(np.array(buckets.pop(b)), int(self.boundaries[b]))
        if not self.drop_remainder:
            for b, rest in sorted(buckets.items()):
                yield self.data._batch(np.array(rest), int(self.boundaries[b]))
