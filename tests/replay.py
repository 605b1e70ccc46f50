"""Random choices a failing test can repeat: the seed comes from ``JDDP_TEST_SEED`` or is drawn and shown."""

from __future__ import annotations

import os

import numpy as np

ENV = "JDDP_TEST_SEED"


def seed() -> int:
    """``$JDDP_TEST_SEED`` if set, else a fresh random seed; printed (pytest shows it when the test fails)."""
    value = int(os.environ[ENV]) if os.environ.get(ENV) else int.from_bytes(os.urandom(4), "little")
    print(f"random choices from seed {value}; repeat them with {ENV}={value}")
    return value


def rng() -> tuple[np.random.Generator, str]:
    """A generator from ``seed()`` and the words that name it in a failure message."""
    value = seed()
    return np.random.default_rng(value), f"seed {value} (repeat with {ENV}={value})"
