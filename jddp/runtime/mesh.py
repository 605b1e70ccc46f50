"""Processes, devices and the data mesh.

Definitions (PyTorch → jddp):

* rank → ``process_index()``: the index of this process, 0 to ``process_count() - 1``.
* world size → ``jax.device_count()``: jddp shards batches over *devices*, and a
  process may own several (``jax.local_device_count()``).
* ``DATA_AXIS = "data"``: the name of the one mesh axis the batch is split over.

Simulated devices: ``simulate_cpu_devices(n)`` gives ``n`` CPU devices in one
process, for demos and tests. It must run before anything touches the JAX
backend (creating an array, listing devices); afterwards it raises
``RuntimeError``.

Guarantee: ``data_mesh()`` orders devices by process, then by local id, so
process ``p`` owns a contiguous block of the mesh and therefore a contiguous
block of rows of every global batch.
"""

from __future__ import annotations

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jddp import validate
from jddp.runtime import jax_internals

DATA_AXIS = "data"

MSG_BACKEND_STARTED = (
    "`simulate_cpu_devices(n={n})` must run before JAX starts its backend, but the "
    "backend is already running with {have} device(s). Call it first thing in the "
    "program, before creating arrays or calling `jax.devices()`, or set "
    "`XLA_FLAGS=--xla_force_host_platform_device_count={n}` in the environment."
)


def simulate_cpu_devices(n: int) -> None:
    """Makes JAX's CPU backend expose ``n`` devices in this process.

    Args:
      n: number of simulated CPU devices, at least 1.

    Raises:
      ValueError: if ``n`` is not a positive integer.
      RuntimeError: if the JAX backend is already running with another device count.
    """
    validate.check_int("n", n)
    if jax_internals.backend_started():
        have = jax.device_count()
        if have == n and jax.default_backend() == "cpu":
            return
        raise RuntimeError(MSG_BACKEND_STARTED.format(n=n, have=have))
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", n)


def process_index() -> int:
    """This process's index (PyTorch's rank)."""
    return jax.process_index()


def process_count() -> int:
    """The number of processes (PyTorch's number of nodes x processes per node)."""
    return jax.process_count()


def is_main_process() -> bool:
    """True on process 0, the one that prints and logs."""
    return jax.process_index() == 0


def data_mesh(
    devices: list[jax.Device] | None = None,  # pyright: ignore[reportInvalidTypeForm]  # jax.Device is public, but an alias variable
) -> Mesh:
    """A 1-D mesh named ``"data"`` over every device of every process.

    The axis type is ``Auto``: jitted steps place host (NumPy) batches on the
    mesh themselves, as ``jax.pmap`` did.

    Args:
      devices: the devices to use; all devices of all processes when ``None``.

    Returns:
      A ``jax.sharding.Mesh`` with the single axis ``DATA_AXIS``.

    Example:
      >>> import jddp
      >>> mesh = jddp.data_mesh()
      >>> mesh.axis_names
      ('data',)
    """
    from jddp.runtime import distributed

    distributed.check_joined()
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("`devices` is empty; pass at least one device or None for all.")
    devices.sort(key=lambda d: (d.process_index, d.id))
    distributed.announce_topology()  # once per run: a script that never calls initialize still says where it runs
    return Mesh(devices, (DATA_AXIS,), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of a value held whole on every device of ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a batch: leading axis split over ``"data"``."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))
