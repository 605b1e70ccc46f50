"""jddp: PyTorch DDP's design for JAX: data-parallel training on shard_map.

Names are imported on first use, so that ``jddp launch`` (``jddp.launch``)
starts worker processes without ever importing JAX itself.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jddp import process_start as _process_start  # noqa: F401  (its IMPORTED_AT: when jddp was first imported)
from jddp._version import __version__

_EXPORTS = {
    "DATA_AXIS": "jddp.runtime",
    "batch_sharding": "jddp.runtime",
    "data_mesh": "jddp.runtime",
    "is_main_process": "jddp.runtime",
    "process_count": "jddp.runtime",
    "process_index": "jddp.runtime",
    "replicated": "jddp.runtime",
    "simulate_cpu_devices": "jddp.runtime",
    "initialize": "jddp.runtime.distributed",
    "barrier": "jddp.runtime.distributed",
    "ProcessGroup": "jddp.runtime.distributed",
    "host_all_gather": "jddp.runtime.host",
    "host_all_reduce": "jddp.runtime.host",
    "host_broadcast": "jddp.runtime.host",
    "EXIT_PEER_LOST": "jddp.exitcodes",
    "EXIT_PREEMPTED": "jddp.exitcodes",
    "EXIT_STALLED": "jddp.exitcodes",
    "heartbeat": "jddp.runtime.progress",
    "phase": "jddp.runtime.progress",
    "CommReport": "jddp.engine.comm",
    "DataParallel": "jddp.engine.parallel",
    "average_gradients": "jddp.engine.own_step",
    "data_parallel": "jddp.engine.own_step",
    "global_mean": "jddp.engine.own_step",
    "NonFiniteError": "jddp.engine.parallel",
    "ReplicaMismatchError": "jddp.engine.replicas",
    "Metrics": "jddp.engine.metrics",
    "RunningMeans": "jddp.engine.metrics",
    "Weighted": "jddp.engine.reduce",
    "masked_mean": "jddp.engine.reduce",
    "TrainState": "jddp.runtime.state",
    "Checkpointer": "jddp.checkpoint",
    "CheckpointError": "jddp.checkpoint",
    "CheckpointLeaseError": "jddp.checkpoint",
    "CheckpointWarning": "jddp.checkpoint",
    "CheckpointStepExistsError": "jddp.checkpoint",
    "register_flush": "jddp.runtime.flush",
    "fit": "jddp.loop",
    "FitResult": "jddp.loop",
}
_SUBMODULES = ("config", "data", "models")

__all__ = [
    "DATA_AXIS",
    "EXIT_PEER_LOST",
    "EXIT_PREEMPTED",
    "EXIT_STALLED",
    "CheckpointError",
    "CheckpointLeaseError",
    "CheckpointStepExistsError",
    "CheckpointWarning",
    "Checkpointer",
    "CommReport",
    "DataParallel",
    "FitResult",
    "Metrics",
    "NonFiniteError",
    "ProcessGroup",
    "ReplicaMismatchError",
    "RunningMeans",
    "TrainState",
    "Weighted",
    "__version__",
    "average_gradients",
    "barrier",
    "batch_sharding",
    "config",
    "data",
    "data_mesh",
    "data_parallel",
    "fit",
    "global_mean",
    "heartbeat",
    "host_all_gather",
    "host_all_reduce",
    "host_broadcast",
    "initialize",
    "is_main_process",
    "masked_mean",
    "models",
    "phase",
    "process_count",
    "process_index",
    "register_flush",
    "replicated",
    "simulate_cpu_devices",
]
assert sorted(__all__) == sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"jddp.{name}")
    else:
        raise AttributeError(f"module 'jddp' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from jddp import config, data, models
    from jddp.checkpoint import (
        Checkpointer,
        CheckpointError,
        CheckpointLeaseError,
        CheckpointStepExistsError,
        CheckpointWarning,
    )
    from jddp.engine.comm import CommReport
    from jddp.engine.metrics import Metrics, RunningMeans
    from jddp.engine.own_step import average_gradients, data_parallel, global_mean
    from jddp.engine.parallel import DataParallel, NonFiniteError
    from jddp.engine.reduce import Weighted, masked_mean
    from jddp.engine.replicas import ReplicaMismatchError
    from jddp.exitcodes import EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_STALLED
    from jddp.loop import FitResult, fit
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
    from jddp.runtime.distributed import ProcessGroup, barrier, initialize
    from jddp.runtime.flush import register_flush
    from jddp.runtime.host import host_all_gather, host_all_reduce, host_broadcast
    from jddp.runtime.progress import heartbeat, phase
    from jddp.runtime.state import TrainState
