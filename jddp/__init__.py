"""jddp: PyTorch DDP's design for JAX: data-parallel training on shard_map."""

from jddp._version import __version__
from jddp.engine.comm import CommReport
from jddp.engine.parallel import DataParallel
from jddp.engine.parallel import NonFiniteError
from jddp.engine.reduce import Weighted
from jddp.engine.reduce import masked_mean
from jddp.engine.state import TrainState
from jddp.runtime import DATA_AXIS
from jddp.runtime import batch_sharding
from jddp.runtime import data_mesh
from jddp.runtime import is_main_process
from jddp.runtime import process_count
from jddp.runtime import process_index
from jddp.runtime import replicated
from jddp.runtime import simulate_cpu_devices

__all__ = [
    "DATA_AXIS",
    "CommReport",
    "DataParallel",
    "NonFiniteError",
    "TrainState",
    "Weighted",
    "__version__",
    "batch_sharding",
    "data_mesh",
    "is_main_process",
    "masked_mean",
    "process_count",
    "process_index",
    "replicated",
    "simulate_cpu_devices",
]
