"""The environment of every process the launcher starts: the ``JDDP_*`` variables of its role (see the manual), its
share of the cores under ``--cpu-share``, and the glibc allocator settings (``MALLOC_TUNABLES``)."""

from __future__ import annotations

import os

from jddp.cli.launch import config as config_lib

ENV_STDOUT_FD = "JDDP_STDOUT_FD"  # the pipe for Python's stdout (jddp.runtime.native_stdout.ENV_STDOUT_FD)
ENV_COORDINATOR_HOSTED = "JDDP_COORDINATOR_HOSTED"  # jddp.runtime.join_settings.ENV_COORDINATOR_HOSTED
ENV_SNAPSHOT_DIR = "JDDP_SNAPSHOT_DIR"  # the run's snapshot directory (jddp.envvars)
MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=17179869184"


def cpu_shares(cores: list[int], nprocs: int) -> list[list[int]]:
    """Each of ``nprocs`` processes' cores: contiguous blocks, as even as they go; with fewer cores than
    processes, each process one core, the cores taken in turn.

    >>> cpu_shares([0, 1, 2, 3, 4], 2), cpu_shares([0, 1], 3)
    ([[0, 1, 2], [3, 4]], [[0], [1], [0]])
    """
    cores = sorted(cores)
    if len(cores) < nprocs:
        return [[cores[i % len(cores)]] for i in range(nprocs)]
    size, extra = divmod(len(cores), nprocs)
    shares, start = [], 0
    for i in range(nprocs):
        end = start + size + (1 if i < extra else 0)
        shares.append(cores[start:end])
        start = end
    return shares


def share_environment(env: dict[str, str], cores: list[int]) -> None:
    """The threads of a process pinned to ``cores``: OpenMP's and XLA's (one core: no Eigen thread pool, whose
    threads would only contend with the process's own), unless the user set them."""
    env.setdefault("OMP_NUM_THREADS", str(len(cores)))
    if len(cores) == 1 and "xla_cpu_multi_thread_eigen" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()


def base_environment(config: config_lib.LaunchConfig) -> dict[str, str]:
    """Our environment plus what every process gets whatever its role: what a spare starts with.

    The allocator settings only on a CPU host: there XLA:CPU's all-reduce allocates fresh buffers every call and
    glibc maps new memory for each (docs/jax_notes.md: +35 to 45% all-reduce bandwidth at 32 to 64 MiB with
    them). On an accelerator the gradients never pass through the host's heap, and a 16 GiB trim threshold would
    only keep freed host memory (the data pipeline's) from going back."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    if config.malloc_tuning and config.platform == "cpu" and "GLIBC_TUNABLES" not in env:
        env["GLIBC_TUNABLES"] = MALLOC_TUNABLES
    return env


def environment(config: config_lib.LaunchConfig, local_rank: int, coordinator: str, attempt: int) -> dict[str, str]:
    """Our environment plus the ``JDDP_*`` variables of process ``local_rank`` on this node (see the manual)."""
    env = base_environment(config)
    env.update(
        JDDP_COORDINATOR=coordinator,
        JDDP_NUM_PROCESSES=str(config.num_processes()),
        JDDP_PROCESS_ID=str(config.first_process_id() + local_rank),
        JDDP_LOCAL_RANK=str(local_rank),
        JDDP_RESTART_COUNT=str(attempt),
        JDDP_MAX_RESTARTS=str(config.max_restarts),
    )
    if config.placements:  # its devices (CUDA_VISIBLE_DEVICES, ...), its platform, for its topology line
        env.update(config.placements[local_rank].env)
    if config.devices_per_process is not None:
        env["JDDP_LOCAL_DEVICES"] = str(config.devices_per_process)
    if config.peer_timeout is not None:
        env["JDDP_PEER_TIMEOUT"] = str(config.peer_timeout)
    if config.init_timeout is not None:
        env["JDDP_INIT_TIMEOUT"] = str(config.init_timeout)
    return env


def cores(config: config_lib.LaunchConfig, local_rank: int, env: dict[str, str]) -> list[int] | None:
    """With ``--cpu-share``: the cores of process ``local_rank`` of this node, its threads set in ``env``."""
    if not (config.cpu_share and config.nprocs > 1 and hasattr(os, "sched_setaffinity")):
        return None
    shares = cpu_shares(sorted(os.sched_getaffinity(0)), config.nprocs)[local_rank]
    share_environment(env, shares)
    return shares


def role_environment(
    config: config_lib.LaunchConfig,
    local_rank: int,
    coordinator: str,
    attempt: int,
    *,
    run_start: float,
    ledger_note: str,
    snapshot_dir: str | None,
    membership: str | None = None,
) -> dict[str, str]:
    """The environment of process ``local_rank`` of attempt ``attempt``, but for the moment it starts at
    (``moment_environment``), with its cores' thread settings under ``--cpu-share``."""
    env = environment(config, local_rank, coordinator, attempt)
    env[ENV_COORDINATOR_HOSTED] = "1"  # node 0's launcher runs it (jddp.cli.launch.service)
    env["JDDP_RUN_START"] = f"{run_start:.6f}"
    env["JDDP_LEDGER_NOTE"] = ledger_note
    if snapshot_dir is not None:
        env[ENV_SNAPSHOT_DIR] = snapshot_dir
    if membership is not None:  # an elastic round's (jddp.cli.launch.elastic), for the goodput ledger
        env["JDDP_MEMBERSHIP"] = membership
    cores(config, local_rank, env)
    return env


def moment_environment(attempt_start: float, previous_end: float | None) -> dict[str, str]:
    """For the goodput ledger (``jddp.goodput``): when this attempt began, and when the group of the previous
    attempt had ended (the time between is downtime)."""
    env = {"JDDP_ATTEMPT_START": f"{attempt_start:.6f}"}
    if previous_end is not None:
        env["JDDP_PREVIOUS_END"] = f"{previous_end:.6f}"
    return env
