"""The data-parallel training engine."""

from jddp.engine.comm import CommReport
from jddp.engine.parallel import DataParallel
from jddp.engine.parallel import NonFiniteError
from jddp.engine.reduce import Weighted
from jddp.engine.reduce import masked_mean
from jddp.engine.state import TrainState

__all__ = ["CommReport", "DataParallel", "NonFiniteError", "TrainState", "Weighted", "masked_mean"]
