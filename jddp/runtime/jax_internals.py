"""Every private JAX API jddp uses, in one place, each with why the public API is not enough.

``jax._src`` changes between releases without notice. Each function here wraps one
private use, and ``tests/test_jax_internals.py`` has a canary per function that
fails with a clear message when a JAX upgrade moves it (``jax<0.11`` is pinned for
that reason). Nothing else in jddp imports ``jax._src``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def backend_started() -> bool:
    """Whether JAX has started its backends (after which the device count and collectives are fixed).

    Public JAX only says so by starting them (``jax.devices()``), which is
    exactly what ``simulate_cpu_devices`` and ``initialize`` must not do.
    """
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def distributed_client() -> Any | None:
    """The coordination service client after ``jax.distributed.initialize`` (None before).

    jddp's watchdog and barriers use its key-value store and barriers;
    ``jax.experimental.multihost_utils`` offers only collectives on devices,
    which a dead peer blocks forever.
    """
    from jax._src import distributed

    return distributed.global_state.client


def coordinator_address() -> str | None:
    """The coordinator address ``jax.distributed.initialize`` settled on (auto-detected on a cluster).

    Public JAX does not return it.
    """
    from jax._src import distributed

    return distributed.global_state.coordinator_address


def detect_cluster(timeout_s: int) -> tuple[str | None, int | None, int | None, list[int] | None]:
    """``(coordinator, num_processes, process_id, local_device_ids)`` as ``jax.distributed.initialize()`` would
    detect them on a cluster (SLURM, Open MPI, Kubernetes...), each None where none is found.

    Public JAX detects them only inside ``initialize``, where process 0 then hosts the coordination service
    itself; jddp needs them first, to host the service in a process of its own.
    """
    from jax._src import clusters

    found = clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, timeout_s)
    coordinator, num_processes, process_id, local_device_ids = found
    return coordinator, num_processes, process_id, None if local_device_ids is None else list(local_device_ids)


def cluster_detected() -> bool:
    """Whether ``jax.distributed.initialize()`` would find a cluster (SLURM, Open MPI, Kubernetes...).

    Public JAX only finds out by joining it; jddp must know first whether there
    is anything to join.
    """
    from jax._src import clusters

    return any(not env.opt_in_only_method and env.is_env_present() for env in clusters.ClusterEnv._cluster_types)


def start_coordination_service(address: str, num_processes: int, heartbeat_timeout_s: int, shutdown_timeout_s: int):
    """Starts JAX's coordination service alone, in this process; returns it (``.shutdown()`` stops it).

    Public JAX starts the service only inside process 0's
    ``jax.distributed.initialize``, so the group's key-value store, barriers and
    heartbeats die with process 0 and JAX aborts every survivor from C++.
    ``jddp launch`` runs the service in a process of its own instead
    (``jddp.runtime.coordinator``), so losing process 0 is like losing any other.
    """
    from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]  # see the docstring

    return _jax.get_distributed_runtime_service(
        address,
        num_processes,
        heartbeat_timeout=heartbeat_timeout_s,
        shutdown_timeout=shutdown_timeout_s,
        recoverable=False,
    )


def use_gloo_with_hostname(hostname: str) -> None:
    """Registers the CPU backend with gloo collectives that advertise ``hostname``.

    gloo advertises the address the machine's hostname resolves to; where that
    is 127.0.0.1 (many Debian hosts), peers on other hosts cannot connect. The
    public ``jax_cpu_collectives_implementation="gloo"`` has no way to give the
    address. Call after ``jax.distributed.initialize`` and before the backend starts.
    """
    from jax._src import xla_bridge
    from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]  # no public API for gloo's hostname

    collectives = _jax.make_gloo_tcp_collectives(distributed_client=distributed_client(), hostname=hostname)
    xla_bridge.register_backend_factory(
        "cpu", functools.partial(xla_bridge.make_cpu_client, collectives=collectives), priority=0, fail_quietly=False
    )


def batched_device_put() -> tuple[Callable, Callable] | None:
    """``(batched_device_put, ShapedArray)``: the C++ call ``jax.device_put`` ends in, or None if it moved.

    Through ``jax.device_put``'s Python layers a batch costs about 70 µs on 8
    simulated devices, straight through this call about 15 µs; on simulated
    devices that host time is taken from the training step (``packing.Transfer``).
    """
    try:
        from jax._src import core
        from jax._src.lib import xla_client  # pyright: ignore[reportPrivateImportUsage]  # see the docstring

        return xla_client.batched_device_put, core.ShapedArray
    except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
        return None


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (``check_vma=True``).

    In jax 0.10 an abstract value carries them as ``jax.typeof(x).mat.varying``
    (``ManualAxisType``; older releases had ``.vma``); neither is public API, and
    the engine needs them to cast a value to varying only once.
    """
    return frozenset(jax.typeof(x).mat.varying)  # pyright: ignore[reportAttributeAccessIssue]  # see the docstring
