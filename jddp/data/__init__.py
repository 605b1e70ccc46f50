"""Data: a world-size-invariant sampler and a Grain loader of global batches."""

from jddp.data.loader import DataLoader
from jddp.data.sampler import DistributedSampler, LocalBatch

__all__ = ["DataLoader", "DistributedSampler", "LocalBatch"]
