"""How a ``DataParallel``'s devices sum: XLA's collectives (packed per dtype, or leaf by leaf) or MPI's, chosen once
from the mesh and the options."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax
from jax.sharding import Mesh

from jddp import envvars
from jddp.engine import fused, mpi

ENV_TRANSPORT = "JDDP_TRANSPORT"  # the default of `transport` (`jddp launch --transport` sets it)


def check_transport(transport: Any) -> None:
    """Raises unless ``transport`` is ``"xla"``, ``"mpi"`` or None (the argument, before the environment is read)."""
    if transport is not None and transport not in ("xla", "mpi"):
        raise ValueError(
            f"`transport` must be 'xla' (XLA's own collectives, gloo across processes on CPU) or 'mpi' "
            f"(MPI_Allreduce through mpi4jax), or None (${ENV_TRANSPORT}, else 'xla'), got {transport!r}."
        )


def psum_of(
    mesh: Mesh, *, fuse_allreduce: bool | None, transport: Any, shard_optimizer: bool, num_devices: int
) -> tuple[Callable, bool, str]:
    """``(psum, fuse_allreduce, transport)``: the sum the step's all-reduces use, whether it packs (``None`` decided
    from the mesh's devices), and the transport (``None`` read from ``$JDDP_TRANSPORT``, else ``"xla"``).

    Raises:
      ValueError: an unknown transport from the environment, or ``transport="mpi"`` with ``shard_optimizer``.
    """
    psum = fused.fused_psum if fuse_allreduce else lax.psum
    if fuse_allreduce is None:  # the same on every process: the mesh is global
        devices = list(mesh.devices.flat)
        fuse_allreduce = all(d.platform == "cpu" for d in devices)
        several = len({d.process_index for d in devices}) > 1
        # Within one process, packing is the faster unless a large leaf would share the all-reduce with the
        # packed buffer (``jddp.engine.fused``): there every leaf goes alone.
        psum = (fused.fused_psum if several else fused.fused_psum_unless_large) if fuse_allreduce else lax.psum
    transport = transport or envvars.get(ENV_TRANSPORT)
    if transport not in ("xla", "mpi"):
        raise ValueError(
            f"`transport` must be 'xla' (XLA's own collectives, gloo across processes on CPU) or 'mpi' "
            f"(MPI_Allreduce through mpi4jax), got {transport!r} (from the argument or ${ENV_TRANSPORT})."
        )
    if transport == "mpi":
        if shard_optimizer:
            raise ValueError(
                "transport='mpi' sums whole gradients (MPI_Allreduce); shard_optimizer=True needs a "
                "reduce-scatter, which only transport='xla' has. Drop one of the two."
            )
        mpi.check(num_devices)
        psum = mpi.mpi_psum
    return psum, fuse_allreduce, transport
