"""The corpus: the Python standard library's own source, byte by byte.

Every Python installation carries its standard library as ``.py`` files
(``sysconfig.get_paths()["stdlib"]``), so the corpus needs no download and no
extra package. A document is one top-level module file (``json`` is a package
and left out, ``argparse.py`` is in); a file goes to the test split when the
CRC-32 of its name is 0 modulo ``test_modulus``, a rule that depends on the
name only, never on which other files exist. Whole files are held out, so no
line of a test module, nor its near-duplicate neighbours, is ever trained on.

Tokens are bytes (vocabulary 256, no tokenizer to build or ship). Each
document is cut into windows of ``seq_len + 1`` bytes that overlap by one (the
inputs are bytes ``0..seq_len-1`` of a window, the targets ``1..seq_len``), so
every byte of a document after its first is predicted exactly once; the last
window of a document is padded and its padding weighted 0.
"""

from __future__ import annotations

import pathlib
import sysconfig
import zlib

import numpy as np


def stdlib_root() -> pathlib.Path:
    """The directory of this Python's standard library."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def documents(root: pathlib.Path | None = None, *, test_modulus: int = 10) -> dict[str, list[bytes]]:
    """The top-level ``.py`` files of ``root`` as ``{"train": [...], "test": [...]}``, sorted by name.

    Raises:
      ValueError: if ``test_modulus`` < 2 or a split comes out empty.
    """
    if test_modulus < 2:
        raise ValueError(f"`test_modulus` must be >= 2 (one file in test_modulus is held out), got {test_modulus}.")
    root = stdlib_root() if root is None else root
    splits: dict[str, list[bytes]] = {"train": [], "test": []}
    for path in sorted(root.glob("*.py")):
        split = "test" if zlib.crc32(path.name.encode()) % test_modulus == 0 else "train"
        splits[split].append(path.read_bytes())
    empty = [k for k, v in splits.items() if not v]
    if empty:
        raise ValueError(
            f"No {empty[0]} documents under {root} with test_modulus={test_modulus}; "
            "the corpus needs the standard library's .py files."
        )
    return splits


def windows(docs: list[bytes], seq_len: int) -> dict[str, np.ndarray]:
    """Every document cut into next-byte-prediction windows.

    Args:
      docs: documents as bytes.
      seq_len: bytes predicted per window.

    Returns:
      ``tokens``: ``[n, seq_len + 1]`` uint8 (the inputs are ``tokens[:, :-1]``, the
      targets ``tokens[:, 1:]``); ``weights``: ``[n, seq_len]`` float32, 1 for a
      real target and 0 for padding. Each byte of a document after its first
      is a target exactly once.
    """
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


def load(seq_len: int, *, test_modulus: int = 10, root: pathlib.Path | None = None) -> dict[str, dict[str, np.ndarray]]:
    """Train and test windows of the standard library corpus: ``{"train": {...}, "test": {...}}``."""
    docs = documents(root, test_modulus=test_modulus)
    return {split: windows(d, seq_len) for split, d in docs.items()}
