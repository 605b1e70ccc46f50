"""The bottom layer: processes, the mesh, program dispatch, the training state and the watchdog.

Modules: ``mesh`` (the data mesh, shardings, simulated CPU devices),
``distributed`` (``initialize``, ``barrier``), ``coordinator`` (the coordination
service in a process of its own, for ``jddp launch``), ``watchdog`` (peer liveness and
exit hooks), ``dispatch`` (the programs in flight on XLA:CPU), ``packing``
(host batches to devices), ``state`` (``TrainState``), ``layout`` (how a sharded
optimizer state is stored) and ``jax_internals``
(every private JAX API jddp uses, in one place). The engine, data and
checkpoint layers import this package and none of each other.
"""

from jddp.runtime.mesh import DATA_AXIS as DATA_AXIS
from jddp.runtime.mesh import MSG_BACKEND_STARTED as MSG_BACKEND_STARTED
from jddp.runtime.mesh import batch_sharding as batch_sharding
from jddp.runtime.mesh import data_mesh as data_mesh
from jddp.runtime.mesh import is_main_process as is_main_process
from jddp.runtime.mesh import process_count as process_count
from jddp.runtime.mesh import process_index as process_index
from jddp.runtime.mesh import replicated as replicated
from jddp.runtime.mesh import simulate_cpu_devices as simulate_cpu_devices

__all__ = [
    "DATA_AXIS",
    "MSG_BACKEND_STARTED",
    "batch_sharding",
    "data_mesh",
    "is_main_process",
    "process_count",
    "process_index",
    "replicated",
    "simulate_cpu_devices",
]
