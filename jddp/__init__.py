"""jddp: PyTorch DDP's design for JAX: data-parallel training on shard_map."""

from jddp import data, models
from jddp._version import __version__
from jddp.engine.comm import CommReport
from jddp.engine.parallel import DataParallel, NonFiniteError
from jddp.engine.reduce import Weighted, masked_mean
from jddp.engine.state import TrainState
from jddp.runtime import (
    DATA_AXIS,
    batch_sharding,
    data_mesh,
    is_main_process,
    process_count,
    process_index,
    replicated,
    simulate_cpu_devices,
)

__all__ = [
    "DATA_AXIS",
    "CommReport",
    "DataParallel",
    "NonFiniteError",
    "TrainState",
    "Weighted",
    "__version__",
    "batch_sharding",
    "data",
    "data_mesh",
    "is_main_process",
    "masked_mean",
    "models",
    "process_count",
    "process_index",
    "replicated",
    "simulate_cpu_devices",
]
