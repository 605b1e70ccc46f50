"""What ``initialize`` joins: its arguments checked, with the environment's defaults filled in.

The environment: ``JDDP_COORDINATOR``, ``JDDP_NUM_PROCESSES``, ``JDDP_PROCESS_ID``, ``JDDP_LOCAL_DEVICES``,
``JDDP_PEER_TIMEOUT`` and ``JDDP_INIT_TIMEOUT`` (``jddp launch`` sets them), else MPI's ``PMI_RANK`` and
``PMI_SIZE`` (``from_mpi``: the MPI world, its coordinator chosen by rank 0), else nothing (a single process, or a
cluster JAX detects).

``JDDP_INIT_TIMEOUT`` (``init_timeout_s``) is the start-up timeout: it bounds the join, and, in the group, every
process's wait for the others before each of jddp's programs first runs (``jddp.runtime.first_run``), the meeting
that keeps gloo's fixed 30-s connection window from failing a process merely slower to start than its peers.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket

from jddp import envvars, net, validate
from jddp.runtime import jax_internals, native_stdout

ENV_COORDINATOR = "JDDP_COORDINATOR"
ENV_NUM_PROCESSES = "JDDP_NUM_PROCESSES"
ENV_PROCESS_ID = "JDDP_PROCESS_ID"
ENV_LOCAL_DEVICES = "JDDP_LOCAL_DEVICES"
ENV_PEER_TIMEOUT = "JDDP_PEER_TIMEOUT"
ENV_INIT_TIMEOUT = "JDDP_INIT_TIMEOUT"
# Set by `jddp launch` (jddp.cli.launch.ENV_COORDINATOR_HOSTED): the coordination service at JDDP_COORDINATOR runs
# in a process of its own (jddp.runtime.coordinator), so process 0 joins it as a client instead of starting it.
ENV_COORDINATOR_HOSTED = "JDDP_COORDINATOR_HOSTED"

DEFAULT_PEER_TIMEOUT_S: float = envvars.VARIABLES[ENV_PEER_TIMEOUT].default  # 30 s
DEFAULT_INIT_TIMEOUT_S: float = envvars.VARIABLES[ENV_INIT_TIMEOUT].default  # 120 s


def env_int(name: str) -> int | None:
    """A variable of MPI's (``PMI_RANK``, ``PMI_SIZE``); jddp's own are read through ``jddp.envvars``."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"Environment variable {name}={raw!r} must be an integer.") from None


def check_arguments(
    *,
    coordinator: object,
    num_processes: object,
    process_id: object,
    local_devices: object,
    init_timeout_s: object,
    peer_timeout_s: object,
    shutdown_timeout_s: object,
    bind_address: object,
    verbose: object,
) -> None:
    """``initialize``'s own arguments, each checked by name before anything starts (the environment's values are
    checked by ``jddp.envvars`` when read)."""
    validate.check_str("coordinator", coordinator, optional=True)
    validate.check_int("num_processes", num_processes, optional=True)
    validate.check_int("process_id", process_id, minimum=0, optional=True)
    validate.check_int("local_devices", local_devices, optional=True)
    validate.check_number("init_timeout_s", init_timeout_s, optional=True, unit="seconds")
    validate.check_number("peer_timeout_s", peer_timeout_s, optional=True, unit="seconds")
    validate.check_number("shutdown_timeout_s", shutdown_timeout_s, unit="seconds")
    validate.check_str("bind_address", bind_address, optional=True)
    validate.check_bool("verbose", verbose)


@dataclasses.dataclass(frozen=True)
class Settings:
    """``initialize``'s arguments with the environment's defaults filled in, checked."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    local_devices: int | None
    init_timeout_s: float
    peer_timeout_s: float
    bind_address: str | None

    @classmethod
    def resolve(cls, coordinator, num_processes, process_id, local_devices, init_timeout_s, peer_timeout_s, bind):
        coordinator = coordinator if coordinator is not None else envvars.get(ENV_COORDINATOR)
        num_processes = num_processes if num_processes is not None else envvars.get(ENV_NUM_PROCESSES)
        process_id = process_id if process_id is not None else envvars.get(ENV_PROCESS_ID)
        if coordinator is None and num_processes is None and process_id is None:
            coordinator, num_processes, process_id = from_mpi() or (None, None, None)
        local_devices = local_devices if local_devices is not None else envvars.get(ENV_LOCAL_DEVICES)
        if init_timeout_s is None:
            init_timeout_s = envvars.get(ENV_INIT_TIMEOUT)
        if peer_timeout_s is None:
            peer_timeout_s = envvars.get(ENV_PEER_TIMEOUT)
        settings = cls(coordinator, num_processes, process_id, local_devices, init_timeout_s, peer_timeout_s, bind)
        settings.check()
        return settings

    def check(self) -> None:
        for name, value in (("init_timeout_s", self.init_timeout_s), ("peer_timeout_s", self.peer_timeout_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"`{name}` must be a positive, finite number of seconds, got {name}={value!r}.")
        given = {"coordinator": self.coordinator, "num_processes": self.num_processes, "process_id": self.process_id}
        if any(v is not None for v in given.values()) and any(v is None for v in given.values()):
            missing = [k for k, v in given.items() if v is None]
            raise ValueError(
                f"jddp.initialize got {', '.join(f'{k}={v!r}' for k, v in given.items())}: a group needs all "
                f"three; {missing} missing. Set {ENV_COORDINATOR}, {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} "
                "together, or start the script with `jddp launch`."
            )
        if self.num_processes is not None:
            assert self.coordinator is not None and self.process_id is not None  # checked above: all three
            if self.num_processes < 1:
                raise ValueError(f"num_processes={self.num_processes} ({ENV_NUM_PROCESSES}) must be at least 1.")
            if not 0 <= self.process_id < self.num_processes:
                raise ValueError(
                    f"process_id={self.process_id} ({ENV_PROCESS_ID}) must be in [0, num_processes="
                    f"{self.num_processes}) ({ENV_NUM_PROCESSES}): process ids run from 0 to {self.num_processes - 1}."
                )
            net.split_address(self.coordinator)

    @property
    def single(self) -> bool:
        """Nothing to join: one process, or no group given and no cluster detected."""
        return self.num_processes == 1 or (self.num_processes is None and not jax_internals.cluster_detected())


def from_mpi() -> tuple[str, int, int] | None:
    """Under MPI's launcher (``mpiexec`` of MPICH's hydra sets ``PMI_RANK`` and ``PMI_SIZE``), the group is the MPI
    world: ``(coordinator, num_processes, process_id)``, with rank 0 choosing the coordinator's address (loopback when
    every rank runs on its host) and broadcasting it. None when not started by MPI's launcher.

    Raises:
      RuntimeError: started by MPI's launcher as several processes, but mpi4py is not installed: each process would
        otherwise train alone.
    """
    rank, size = env_int("PMI_RANK"), env_int("PMI_SIZE")
    if rank is None or size is None or size < 2:
        return None
    try:
        from mpi4py import MPI
    except ImportError as error:
        raise RuntimeError(
            f"This process was started by MPI's launcher as rank {rank} of {size} (PMI_RANK, PMI_SIZE), but mpi4py "
            f"cannot be imported ({error}), so jddp cannot join the others. Install jddp's MPI extra "
            '(`pip install "jddp[mpi]"`), or start the processes with `jddp launch -n N`.'
        ) from None
    native_stdout.filter_native_stdout()
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    address = None
    if comm.Get_rank() == 0:
        host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        address = f"{host}:{net.free_port(host if host == '127.0.0.1' else '0.0.0.0')}"
    address = comm.bcast(address, root=0)
    return address, comm.Get_size(), comm.Get_rank()


def join_arguments(
    settings: Settings,
    *,
    bind: str,
    local_device_ids: list[int] | None,
    timeout_s: float,
    heartbeat_s: int,
    shutdown_s: int,
) -> dict:
    """The keyword arguments of ``jax.distributed.initialize`` for a group given in full by ``settings``.

    ``local_device_ids`` stays None under ``jddp launch``, also on a GPU host: the launcher gave each process its
    GPUs through the driver (``CUDA_VISIBLE_DEVICES``, ``jddp.placement``), so every device the process sees is its
    own, which is what None means to JAX. A cluster JAX detects (SLURM) may give them (``detect_cluster``).
    """
    return dict(
        coordinator_address=settings.coordinator,
        num_processes=settings.num_processes,
        process_id=settings.process_id,
        local_device_ids=local_device_ids,
        coordinator_bind_address=bind,
        initialization_timeout=max(1, int(timeout_s)),
        heartbeat_timeout_seconds=heartbeat_s,
        shutdown_timeout_seconds=shutdown_s,
    )
