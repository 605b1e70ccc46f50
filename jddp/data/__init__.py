"""Data: a world-size-invariant sampler and a Grain loader of global batches.

Names load on first use, so that importing the sampler (NumPy only) through this
package does not pull in JAX and Grain.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "Buckets": "jddp.data.buckets",
    "DataLoader": "jddp.data.loader",
    "DtypeWarning": "jddp.data.fields",
    "DistributedBatchSampler": "jddp.data.sampler",
    "LocalBatch": "jddp.data.sampler",
}

__all__ = ["Buckets", "DataLoader", "DistributedBatchSampler", "DtypeWarning", "LocalBatch"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jddp.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from jddp.data.buckets import Buckets
    from jddp.data.fields import DtypeWarning
    from jddp.data.loader import DataLoader
    from jddp.data.sampler import DistributedBatchSampler, LocalBatch
