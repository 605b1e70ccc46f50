"""The data-parallel training engine."""

from jddp.engine.comm import CommReport
from jddp.engine.metrics import Metrics, RunningMeans
from jddp.engine.parallel import DataParallel, NonFiniteError
from jddp.engine.reduce import Weighted, masked_mean
from jddp.runtime.state import TrainState

__all__ = [
    "CommReport",
    "DataParallel",
    "Metrics",
    "NonFiniteError",
    "RunningMeans",
    "TrainState",
    "Weighted",
    "masked_mean",
]
