"""The cross-process sum through MPI: ``DataParallel(transport="mpi")`` (the ``jddp[mpi]`` extra, on mpi4jax).

XLA:CPU's gloo all-reduce is out of place, allocates per call and runs one
ring per operand (docs/jax_notes.md). MPI's ``MPI_Allreduce`` (MPICH over shared memory
or TCP) reduces the same bytes with less overhead. mpi4jax exposes it as an XLA
FFI custom call (``mpi_allreduce_ffi``), but its JAX primitive carries an
*ordered effect*, and JAX refuses ordered effects in a program of more than one
device: a data-parallel step over several processes is exactly that. So jddp
binds the same FFI target through a primitive of its own:

* no ordered effect: the sums of one step are issued in one chain (each call's
  token is the previous call's), inside one program that every process runs
  alike, so every rank issues the same MPI calls in the same order;
* its abstract evaluation is ``lax.psum``'s (the result is invariant over the
  data axis), so ``shard_map`` treats it as the all-reduce it is;
* the small leaves of a dtype travel packed in one buffer (``mpi_psum``), as
  with ``fuse_allreduce``; the large ones are summed where they lie;
* floats MPI has no type for (bfloat16, float16: ``reduce_dtype``) are summed
  in float32 and cast back, so ``reduce_dtype`` saves no bytes on this
  transport; other types it cannot sum are refused, naming the dtype.

Each process must hold exactly one device of the mesh: every device of a
process runs the step program, and several devices of one process would each
call ``MPI_Allreduce`` on the same communicator. The MPI world must be the JAX
group: rank ``i`` is process ``i`` (``check``). Exactness is the gloo path's:
one sum of the gradients, the counts and the metrics per step, divided once
(tested against the gloo transport in ``tests/test_mpi.py``).

Failure semantics stay jddp's: a process blocked in ``MPI_Allreduce`` on a
dead peer holds no GIL, so its watchdog still finds the peer silent and exits
69 naming it (``jddp.runtime.watchdog``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jddp.engine import fused

INSTALL = (
    'pip install "jddp[mpi]" (the mpich and mpi4py wheels, and mpi4jax, built from source with the mpicc of the '
    "mpich wheel: put the venv's bin first on PATH; if a CUDA compiler is on PATH without CUDA's headers, hide it "
    "from the build, for example PATH=$VIRTUAL_ENV/bin:/usr/bin:/bin pip install mpi4jax)"
)


def unavailable() -> str | None:
    """Why the MPI transport cannot run here (the import error and how to install), or None when it can."""
    try:
        import mpi4jax  # noqa: F401  # registers the mpi_allreduce_ffi target with XLA
        from mpi4py import MPI  # noqa: F401
    except Exception as error:  # ImportError, or a broken MPI library (OSError, RuntimeError)
        return f"{type(error).__name__}: {error}. Install it with {INSTALL}."
    return None


def check(num_devices: int) -> None:
    """Raises unless the MPI transport can run the step of a mesh of ``num_devices`` devices in this group.

    Raises:
      RuntimeError: mpi4jax or MPI is missing (why, and how to install), or the MPI world is not the JAX group
        (the sizes and ranks, and how to start the processes).
      ValueError: a process holds more than one device of the mesh.
    """
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"transport='mpi' needs mpi4jax and an MPI library: {reason}")
    from mpi4py import MPI

    size, rank = MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank()
    if size != jax.process_count() or rank != jax.process_index():
        raise RuntimeError(
            f"transport='mpi': the MPI world (size {size}, this rank {rank}) is not the JAX group (process "
            f"{jax.process_index()} of {jax.process_count()}). Start the processes with MPI's launcher so that MPI "
            "rank i is JAX process i: `mpiexec -n N python train.py` (jddp.initialize() then joins by the MPI rank), "
            "`jddp launch --transport mpi -n N train.py`, or srun with MPI support."
        )
    if num_devices != jax.process_count():
        raise ValueError(
            f"transport='mpi' needs one device per process, got a mesh of {num_devices} device(s) over "
            f"{jax.process_count()} process(es). Start one process per device (`jddp launch --transport mpi -n "
            f"{num_devices}`, without --devices-per-process), or use transport='xla'."
        )


@functools.cache
def _comm():
    """A communicator of jddp's own (a duplicate of COMM_WORLD), so that the user's MPI calls never interleave
    with the step's. Created at the first step, collectively: every process builds its step alike."""
    from mpi4jax._src.utils import wrap_as_hashable  # the comm as mpi4jax's FFI target takes it
    from mpi4py import MPI

    return wrap_as_hashable(MPI.COMM_WORLD.Clone())


PACK_BELOW_BYTES = 256 << 10  # leaves smaller than this share a buffer; larger ones are summed where they lie


def mpi_psum(tree, axis_name: str, pack_below_bytes: int = PACK_BELOW_BYTES):
    """``lax.psum(tree, axis_name)`` through ``MPI_Allreduce``, inside ``shard_map`` over a mesh of one device per
    process (``check``). The leaves under ``pack_below_bytes`` travel packed in one buffer per dtype (an MPI call
    costs tens of microseconds); larger leaves are summed where they lie, one call each, which spares copying them
    into a buffer and out again (measured: packing every leaf of the 7.5 MB MLP cost the step more than the calls
    it saved)."""
    leaves, treedef = jax.tree.flatten(tree)
    dtypes = [np.dtype(x.dtype) for x in leaves]
    leaves = [x if d.name in _MPI_TYPES else _wire(x, d) for x, d in zip(leaves, dtypes, strict=True)]
    groups, large = fused._grouped(leaves, pack_below_bytes)
    leaves = fused._fenced(leaves, groups)
    flats = [jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]) for idx in groups.values()]
    operands = [*flats, *(leaves[i] for i in large)]
    summed = _allreduce().bind(*operands, comm=_comm(), axis_name=axis_name) if operands else []
    out = list(leaves)
    for i, x in zip(large, summed[len(flats) :], strict=True):
        out[i] = x
    for idx, flat in zip(groups.values(), summed[: len(flats)], strict=True):
        offset = 0
        for i in idx:
            size = int(np.prod(np.shape(leaves[i]), dtype=np.int64))
            out[i] = flat[offset : offset + size].reshape(np.shape(leaves[i]))
            offset += size
    out = [x if x.dtype == d else x.astype(d) for x, d in zip(out, dtypes, strict=True)]
    return jax.tree.unflatten(treedef, out)


# The dtypes MPI sums (mpi4jax's map); other floats (bfloat16, float16, float8) are summed in float32.
_MPI_TYPES = frozenset(
    {"float32", "float64", "complex64", "complex128", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
     "uint64"}
)  # fmt: skip


def _wire(x, dtype: np.dtype):
    """``x`` as MPI can sum it: a float type MPI has none for (``reduce_dtype=jnp.bfloat16``, float16) in float32,
    so it is summed in float32 and cast back, on twice the bytes; any other type is refused."""
    if jnp.issubdtype(dtype, jnp.floating):
        return x.astype(jnp.float32)
    raise TypeError(
        f"transport='mpi' cannot sum a value of dtype {dtype.name} (shape {tuple(np.shape(x))}): MPI sums "
        f"{', '.join(sorted(_MPI_TYPES))}, and jddp sums other floats in float32. Cast the value (a metric or a "
        "model-state leaf) to one of those, or use transport='xla'."
    )


# -- the primitive (mpi4jax's private helpers, pinned by the extra's version range; JAX's in jax_internals) -------


def _make_primitive():
    def attributes(aval, *, comm) -> dict:
        from mpi4jax._src.utils import to_dtype_handle, to_mpi_handle, unpack_hashable
        from mpi4py import MPI

        return {
            "nitems": np.int64(np.prod(aval.shape, dtype=np.int64)),
            "op": np.int64(to_mpi_handle(MPI.SUM)),
            "comm": np.int64(to_mpi_handle(unpack_hashable(comm))),
            "dtype": np.int64(to_dtype_handle(aval.dtype)),
        }

    from jddp.runtime import jax_internals

    return jax_internals.ffi_sum_primitive("jddp_mpi_allreduce", "mpi_allreduce_ffi", attributes)


@functools.cache
def _allreduce():
    """The primitive, made at its first use: importing jddp must not import mpi4jax."""
    return _make_primitive()
