"""The engine's device programs lowered for a platform, which need not be this machine's: what
``DataParallel.lower`` and ``DataParallel.comm_report(..., platform=...)`` read.

JAX lowers any program for ``cuda``, ``rocm`` or ``tpu`` with no device of that kind present
(``lowering_platforms``); compiling needs the device. So on a CPU machine a step can be checked for an accelerator
up to its StableHLO: its collectives, its donation and shardings, and that nothing in it exists only for the CPU (a
host callback, a CPU-only primitive such as ``mpi4jax``'s), which is what ``tests/test_lowering.py`` does for every
program the engine builds.
"""

from __future__ import annotations

from typing import Any

import jax

from jddp.engine import comm, replicas
from jddp.runtime.state import TrainState

PROGRAMS = ("step", "eval", "replica_check")


def lower(dp: Any, state: TrainState, batch, *, platform: str, program: str = "step") -> jax.stages.Lowered:
    """``dp``'s (a ``DataParallel``, which calls this) ``program`` for ``state`` and ``batch``, traced and lowered
    for ``platform``, nothing run."""
    comm.check_platform(platform)
    if program not in PROGRAMS:
        raise ValueError(
            f"`program` must be one of {', '.join(repr(p) for p in PROGRAMS)}, got program={program!r}: the "
            "training step, the evaluation step, or the replica check's checksums."
        )
    if program == "step":
        return comm.lower_for(dp._program(state), dp._args(state, batch), platform)
    if program == "eval":
        return comm.lower_for(dp._programs.eval, dp._eval_args(state, batch), platform)
    jitted, leaves = replicas.checksum_program(state, dp.mesh)
    return comm.lower_for(jitted, tuple(leaves), platform)
