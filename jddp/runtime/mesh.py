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
from jddp.runtime import jax_internals, process_group, topology

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
    process_group.check_joined()
    if devices is not None and (isinstance(devices, str | bytes) or not hasattr(devices, "__iter__")):
        raise TypeError(
            f"`devices` must be a list of jax devices (e.g. `jax.devices()[:4]`) or None for all, got "
            f"devices={devices!r}."
        )
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("`devices` is empty; pass at least one device or None for all.")
    odd = next((d for d in devices if not isinstance(d, jax.Device)), None)
    if odd is not None:
        raise TypeError(
            f"`devices` must hold jax devices (from `jax.devices()`), got {type(odd).__name__} ({odd!r:.40}) among "
            "them."
        )
    if len(set(devices)) != len(devices):
        raise ValueError(f"`devices` names a device more than once, got devices={devices}; list each once.")
    devices.sort(key=lambda d: (d.process_index, d.id))
    topology.announce_topology()  # once per run: a script that never calls initialize still says where it runs
    return Mesh(devices, (DATA_AXIS,), axis_types=(AxisType.Auto,))


def check_mesh(name: str, mesh: object, *, data_axis: bool = True) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``mesh`` is a ``jax.sharding.Mesh`` with (if ``data_axis``) an
    axis ``"data"``."""
    if not isinstance(mesh, Mesh) or (data_axis and DATA_AXIS not in mesh.axis_names):
        axis = f" with an axis named {DATA_AXIS!r}" if data_axis else ""
        raise ValueError(f"`{name}` must be a jax.sharding.Mesh{axis}, got {mesh!r:.80}; use `jddp.data_mesh()`.")


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of a value held whole on every device of ``mesh`` (any mesh)."""
    check_mesh("mesh", mesh, data_axis=False)
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The sharding of a batch: leading axis split over ``"data"``."""
    check_mesh("mesh", mesh)
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))
