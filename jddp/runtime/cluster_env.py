"""The environment checked whole: ``JDDP_*`` variables jddp does not know, and schedulers' variables partly present.

``jddp.initialize`` calls ``warn_environment`` once per process, before it joins a group or runs alone:

* **unknown variables**: a ``JDDP_*`` variable that ``jddp.envvars.VARIABLES`` does not declare (a typo of
  ``JDDP_PEER_TIMEOUT`` would otherwise be ignored in silence) is named with the closest declared one (``difflib``);
* **a partial scheduler environment**: when the process is about to run alone as process 0 of 1 although some of
  a scheduler's variables are set (``SCHEDULERS``: SLURM without ``srun``'s step variables, Open MPI 5 without
  ``OMPI_MCA_orte_hnp_uri``, ``PMI_RANK`` without ``PMI_SIZE``, JAX's own ``JAX_COORDINATOR_ADDRESS``...), the
  warning names the scheduler, the variables present and those missing.

Only process 0 of a run's first attempt warns (the index read from ``JDDP_PROCESS_ID``, ``SLURM_PROCID``,
``OMPI_COMM_WORLD_RANK`` or ``PMI_RANK`` before any group is joined; ``JDDP_RESTART_COUNT`` 0): every process of a
group inherits the same environment, so one warning says it for all of them, and ``jddp launch``'s restarts do not
repeat it. Not at ``import jddp``: the launcher's parent, its spares, Grain's worker processes and every child import
jddp, which would print the warning once for each. The pure functions (``unknown_variables``, ``partial_schedulers``,
``environment_warnings``) take the environment as an argument; this module imports no JAX.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import warnings
from collections.abc import Mapping

from jddp import envvars

# What follows "JDDP_" in the test suite's own variables (tests/replay.py, tests/semantic_mutants.py), passed to the
# processes tests start: not jddp's, never warned about.
NOT_JDDPS = ("TEST_", "SEMANTIC_")


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """One way a group of processes is described by the environment.

    ``needs``: every variable the group's reader needs (all present: the group is found); ``joins``: whether the
    complete set makes ``jddp.initialize`` join a group (False: jddp and this JAX read only part of it, so the process
    runs alone even with all of them); ``fix``: what to do."""

    name: str
    needs: tuple[str, ...]
    reader: str
    fix: str
    joins: bool = True
    detected: bool = False  # JAX's cluster detection finds it, perhaps from part of ``needs`` (refuse_partial)


# The source of truth for what initialize accepts as a group; SLURM's and Open MPI's sets are those of JAX's cluster
# detection (jax/_src/clusters/slurm_cluster.py and ompi_cluster.py: is_env_present), which tests compare.
SCHEDULERS: tuple[Scheduler, ...] = (
    Scheduler(
        "jddp",
        ("JDDP_COORDINATOR", "JDDP_NUM_PROCESSES", "JDDP_PROCESS_ID"),
        "jddp.initialize",
        "set all three, or start the script with `jddp launch`",
    ),
    Scheduler(
        "SLURM",
        ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
        "JAX's SLURM detection (jax.distributed.initialize)",
        "start each process with `srun` inside the allocation (sbatch's and salloc's shells set only the job's "
        "variables, not the step's), or start the script with `jddp launch`",
        detected=True,
    ),
    Scheduler(
        "Open MPI",
        ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
        "JAX's Open MPI detection (jax.distributed.initialize)",
        "start the processes with Open MPI 4's `mpirun` (Open MPI 5 no longer sets OMPI_MCA_orte_hnp_uri), or set "
        "JDDP_COORDINATOR, JDDP_NUM_PROCESSES and JDDP_PROCESS_ID for each process, or use `jddp launch`",
        detected=True,
    ),
    Scheduler(
        "MPICH (PMI)",
        ("PMI_RANK", "PMI_SIZE"),
        "jddp.initialize (MPI's world through mpi4py)",
        "start the processes with MPICH's `mpiexec`, which sets both",
    ),
    Scheduler(
        "JAX",
        ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
        "jax.distributed.initialize, which reads JAX_COORDINATOR_ADDRESS only, with a detected cluster",
        "set JDDP_COORDINATOR, JDDP_NUM_PROCESSES and JDDP_PROCESS_ID instead (jddp.initialize reads those), or "
        "start the script with `jddp launch`",
        joins=False,
    ),
)
# Where each scheduler puts the process's index, read before any group is joined (first found wins).
RANK_VARIABLES = ("JDDP_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
_warned = False  # this process said it already


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """Each ``JDDP_*`` name in ``environ`` that ``jddp.envvars.VARIABLES`` does not declare, with the closest
    declared name (None when none is close), sorted."""
    known = list(envvars.VARIABLES)
    out = []
    for name in sorted(environ):
        if name.startswith("JDDP_") and name not in envvars.VARIABLES and not name[5:].startswith(NOT_JDDPS):
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
            out.append((name, close[0] if close else None))
    return out


def partial_schedulers(environ: Mapping[str, str]) -> list[tuple[Scheduler, list[str], list[str]]]:
    """Each scheduler of ``SCHEDULERS`` with variables in ``environ`` that do not make a group jddp joins, with the
    variables present and those missing (a set present in full is not listed unless its scheduler never ``joins``)."""
    out = []
    for scheduler in SCHEDULERS:
        present = [v for v in scheduler.needs if v in environ]
        missing = [v for v in scheduler.needs if v not in environ]
        if present and (missing or not scheduler.joins):
            out.append((scheduler, present, missing))
    return out


def environment_warnings(environ: Mapping[str, str], *, alone: bool) -> list[str]:
    """The warnings for ``environ`` (see the module docstring); ``alone``: the process is about to run as process
    0 of 1, having found no group to join."""
    said = []
    for name, close in unknown_variables(environ):
        hint = f"did you mean {close}?" if close else "no declared variable is close"
        said.append(
            f"${name} is not a jddp variable and is ignored ({hint}); the variables jddp reads are listed in "
            "jddp.envvars.VARIABLES (docs: the launcher's manual). Unset it or correct its name."
        )
    if alone:
        for scheduler, present, missing in partial_schedulers(environ):
            values = ", ".join(f"{v}={environ[v]!r}" for v in present)
            lack = f"missing {', '.join(missing)}" if missing else "all present, but only part of them is read"
            said.append(
                f"{scheduler.name}'s variables are set ({values}) but this process runs alone as process 0 of 1: "
                f"{scheduler.reader} needs {', '.join(scheduler.needs)}; {lack}. To join the group, {scheduler.fix}."
            )
    return said


def refuse_partial(environ: Mapping[str, str]) -> None:
    """Where JAX detected a cluster: refuses one whose variables are partly present (JAX's Open MPI detection needs
    only ``OMPI_MCA_orte_hnp_uri`` and then fails on the first missing ``OMPI_COMM_WORLD_*`` with a ``KeyError``).

    Raises:
      ValueError: naming the scheduler, the variables present and those missing, before anything is joined.
    """
    for scheduler, present, missing in partial_schedulers(environ):
        if scheduler.detected:
            raise ValueError(
                f"{scheduler.name}'s variables are partly set ({', '.join(present)} present, {', '.join(missing)} "
                f"missing): {scheduler.reader} found a cluster but cannot join it without them. To join the group, "
                f"{scheduler.fix}."
            )


def reports(environ: Mapping[str, str]) -> bool:
    """Whether this process is the one that warns: process 0 (by ``RANK_VARIABLES``) of the first attempt."""
    if envvars.get("JDDP_RESTART_COUNT", environ):
        return False  # jddp launch restarted the group: its first attempt said it
    for name in RANK_VARIABLES:
        if name in envvars.VARIABLES:
            rank = envvars.get(name, environ)
            if rank is not None:
                return rank == 0
            continue
        text = environ.get(name, "").strip()
        if text:
            return text == "0"
    return True


def warn_environment(*, alone: bool, environ: Mapping[str, str] | None = None) -> None:
    """``environment_warnings`` as ``RuntimeWarning``s, once per process and only where ``reports`` says so."""
    global _warned
    environ = os.environ if environ is None else environ
    if _warned or not reports(environ):
        return
    _warned = True
    for message in environment_warnings(environ, alone=alone):
        warnings.warn(message, RuntimeWarning, stacklevel=3)
