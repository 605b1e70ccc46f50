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


def make_cache_writes_atomic() -> bool:
    """Makes JAX's persistent compilation cache write each entry atomically (a temporary file, then a rename).

    JAX's ``LRUCache.put`` (jax 0.10, without a size limit) writes the entry in place with
    ``Path.write_bytes`` and never rewrites an entry that exists. A process killed in the middle of that write
    (a SIGKILL during the first compile is an ordinary way for a run to end) leaves a truncated entry that every
    later run fails to read, warns about, recompiles and cannot replace; two processes of one group writing the
    same entry can also let a third read it half written. Returns False (and changes nothing) when this JAX's
    cache is not the one expected.
    """
    import os

    from jax._src import lru_cache

    cls = lru_cache.LRUCache
    if getattr(cls.put, "_jddp_atomic", False):
        return True
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    if suffix is None or not callable(getattr(cls, "put", None)):
        return False
    original = cls.put

    def put(self, key: str, value: bytes) -> None:
        if not key or getattr(self, "eviction_enabled", True):
            return original(self, key, value)  # with a size limit JAX locks and evicts: leave that path as it is
        path = self.path / f"{key}{suffix}"
        if path.exists():
            return
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_bytes(value)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    put._jddp_atomic = True  # type: ignore[attr-defined]
    cls.put = put
    return True


def cache_writes_from_every_process() -> bool:
    """Lets every process of a group write its compiled programs to the persistent compilation cache.

    JAX 0.10 writes cache entries from process 0 only (``compiler._cache_write``: "contention for writes on some
    filesystems"). On CPU the other processes' programs have keys of their own (measured: process 1 of 2 found
    none of its 10 programs after a run), so without this a restarted group waits for every other process to
    compile from scratch, and process 0's cache saves nothing. The replacement is JAX's own function without that
    one test; entries are written atomically (``make_cache_writes_atomic``), so processes that do share a key
    cannot corrupt it. Returns False (and changes nothing) when this JAX's function is not the one expected.
    """
    import inspect
    import logging
    import warnings

    from jax._src import compilation_cache, compiler
    from jax._src import config as jax_config

    original = getattr(compiler, "_cache_write", None)
    if original is None or getattr(original, "_jddp", False):
        return original is not None
    try:
        expected = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]
        if list(inspect.signature(original).parameters) != expected:
            return False
    except (TypeError, ValueError):
        return False
    logger = logging.getLogger(compiler.__name__)

    def _cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks) -> None:
        if host_callbacks:
            return  # as JAX: host callbacks are baked into the program
        if compile_time_secs < jax_config.persistent_cache_min_compile_time_secs.value:
            return
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as ex:
            if compiler._should_raise_persistent_cache_error(ex):
                raise
            logger.debug("cache write failed", exc_info=True)
            warnings.warn(
                f"Error writing persistent compilation cache entry for '{module_name}': {type(ex).__name__}: {ex}",
                stacklevel=2,
            )

    _cache_write._jddp = True  # type: ignore[attr-defined]
    compiler._cache_write = _cache_write
    return True


def ffi_sum_primitive(name: str, target: str, attributes):
    """A primitive that sums each of its operands over a mesh axis through the FFI custom call ``target`` (an
    external library's collective, such as MPI's allreduce of mpi4jax), for use inside ``shard_map``.

    ``bind(*operands, axis_name=..., **params)``: one call of ``target`` per operand, with side effects, each
    taking and returning a token chained from the previous call (made in the lowering), with the attributes
    ``attributes(aval, **params)``. Its abstract evaluation is ``lax.psum``'s: the results are invariant over
    ``axis_name``. Public JAX offers only ordered effects for such calls (mpi4jax's own primitives), which JAX
    0.10 refuses in any program of more than one device, as a multi-process step is; the token chain keeps
    the calls in one order on every process instead.
    """
    from jax._src import core
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir.dialects import hlo

    p = core.Primitive(name)
    p.multiple_results = True

    def abstract_eval(*avals, axis_name, **params):
        del params
        out = []
        for aval in avals:
            varying = frozenset(a for a in aval.mat.varying if a != axis_name)
            out.append(aval.update(manual_axis_type=aval.mat.update(varying=varying)))
        return out, {core.NamedAxisEffect(axis_name)}

    p.def_effectful_abstract_eval(abstract_eval)

    def lowering(ctx, *args, axis_name, **params):
        del axis_name
        import jax

        call = jax.ffi.ffi_lowering(target, has_side_effect=True)
        token = hlo.create_token()
        results = []
        for x, aval_in, aval_out in zip(args, ctx.avals_in, ctx.avals_out, strict=True):
            one = ctx.replace(avals_in=(aval_in, core.abstract_token), avals_out=(aval_out, core.abstract_token))
            result, token = call(one, x, token, **attributes(aval_in, **params))
            results.append(result)
        return results

    mlir.register_lowering(p, lowering, platform="cpu")
    return p
