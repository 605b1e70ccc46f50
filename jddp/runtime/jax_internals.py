"""Every private JAX API jddp uses, in one place, each with why the public API is not enough.

``jax._src`` changes between releases without notice. Each function here wraps one private use and finds it by
feature detection (the newer location first, then the older; keyword arguments by the callee's signature), never by
comparing version numbers. Where nothing fits it raises ``JaxInternalsError`` naming ``jax.__version__``; the two
optional speed-ups (``batched_device_put``, the two compilation-cache patches) return None/False instead, as before.
Checked against jax/jaxlib 0.10.2, 0.11.0 (git tag), 0.11.2 and 0.12.0.1 (PyPI wheels).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax

_MISSING = object()


class JaxInternalsError(RuntimeError):
    """A private JAX API that jddp relies on is not where any supported JAX release had it."""


def _versions() -> str:
    try:
        import jaxlib

        lib = getattr(jaxlib, "__version__", "?")
    except ImportError:  # pragma: no cover
        lib = "not installed"
    return f"jax {getattr(jax, '__version__', '?')} (jaxlib {lib})"


def _missing(function: str, tried: Iterable[str]) -> JaxInternalsError:
    return JaxInternalsError(
        f"{_versions()}: jddp.runtime.jax_internals.{function} found none of {', '.join(tried)}. This JAX moved a "
        "private API jddp needs: install a JAX release in jddp's supported range, or update that function."
    )


def _lookup(*candidates: str) -> Any:
    """The first of ``"pkg.module:attr.attr"`` that imports and resolves, else ``_MISSING``."""
    for candidate in candidates:
        module_name, _, attrs = candidate.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in filter(None, attrs.split(".")):
            obj = getattr(obj, attr, _MISSING)
            if obj is _MISSING:
                break
        if obj is not _MISSING:
            return obj
    return _MISSING


def _require(function: str, *candidates: str) -> Any:
    found = _lookup(*candidates)
    if found is _MISSING:
        raise _missing(function, candidates)
    return found


def _parameters(fn: Callable) -> set[str] | None:
    """Names ``fn`` accepts, for Python functions and nanobind ones (``inspect.signature`` refuses the latter)."""
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        pass
    texts = [entry[0] for entry in getattr(fn, "__nb_signature__", ()) if entry and isinstance(entry[0], str)]
    texts = texts or [(getattr(fn, "__doc__", None) or "").split("\n", 1)[0]]
    names: set[str] = set()
    for text in texts:  # "name(a: int, b: dict[str, int] | None = None) -> T": split on top-level commas
        start = text.find("(")
        depth, part, parts = 0, "", []
        for ch in text[start + 1 :] if start >= 0 else "":
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:
                    break
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(part)
                part = ""
            else:
                part += ch
        parts.append(part)
        for piece in parts:
            match = re.match(r"\s*\*{0,2}([A-Za-z_]\w*)", piece)
            if match:
                names.add(match.group(1))
    return names or None


def backend_started() -> bool:
    """Whether JAX has started its backends (after which the device count and collectives are fixed).

    Public JAX only says so by starting them (``jax.devices()``), which is
    exactly what ``simulate_cpu_devices`` and ``initialize`` must not do.
    """
    fn = _lookup("jax._src.xla_bridge:backends_are_initialized")
    if fn is not _MISSING:
        return bool(fn())
    backends = _lookup("jax._src.xla_bridge:_backends")  # what backends_are_initialized reads (0.10-0.12)
    if isinstance(backends, dict):
        return len(backends) != 0
    raise _missing("backend_started", ["jax._src.xla_bridge.backends_are_initialized", "xla_bridge._backends"])


def _global_state(function: str) -> Any:
    state = _require(function, "jax._src.distributed:global_state")
    if not hasattr(state, "client") or not hasattr(state, "coordinator_address"):
        raise _missing(function, ["jax._src.distributed.global_state.client / .coordinator_address"])
    return state


def distributed_client() -> Any | None:
    """The coordination service client after ``jax.distributed.initialize`` (None before).

    jddp's watchdog and barriers use its key-value store and barriers;
    ``jax.experimental.multihost_utils`` offers only collectives on devices,
    which a dead peer blocks forever.
    """
    return _global_state("distributed_client").client


def coordinator_address() -> str | None:
    """The coordinator address ``jax.distributed.initialize`` settled on (auto-detected on a cluster).

    Public JAX does not return it.
    """
    return _global_state("coordinator_address").coordinator_address


def _cluster_env(function: str) -> Any:
    env = _require(function, "jax._src.clusters:ClusterEnv", "jax._src.clusters.cluster:ClusterEnv")
    if not isinstance(getattr(env, "_cluster_types", None), list):
        raise _missing(function, ["jax._src.clusters.ClusterEnv._cluster_types"])
    return env


def detect_cluster(timeout_s: int) -> tuple[str | None, int | None, int | None, list[int] | None]:
    """``(coordinator, num_processes, process_id, local_device_ids)`` as ``jax.distributed.initialize()`` would
    detect them on a cluster (SLURM, Open MPI, Kubernetes...), each None where none is found.

    Public JAX detects them only inside ``initialize``, where process 0 then hosts the coordination service
    itself; jddp needs them first, to host the service in a process of its own.
    """
    env = _cluster_env("detect_cluster")
    detect = getattr(env, "auto_detect_unset_distributed_params", None)
    if not callable(detect):
        raise _missing("detect_cluster", ["ClusterEnv.auto_detect_unset_distributed_params"])
    names = _parameters(detect) or set()
    found: Any
    wanted = {"coordinator_address", "num_processes", "process_id", "local_device_ids", "cluster_detection_method",
              "initialization_timeout"}  # fmt: skip
    if wanted <= names:
        found = detect(coordinator_address=None, num_processes=None, process_id=None, local_device_ids=None,
                       cluster_detection_method=None, initialization_timeout=timeout_s)  # fmt: skip
    elif not names:  # no signature to read: JAX 0.10-0.12's positional order
        found = detect(None, None, None, None, None, timeout_s)
    else:
        raise _missing(
            "detect_cluster", [f"ClusterEnv.auto_detect_unset_distributed_params({', '.join(sorted(wanted))})"]
        )
    coordinator, num_processes, process_id, local_device_ids = found
    return coordinator, num_processes, process_id, None if local_device_ids is None else list(local_device_ids)


def cluster_detected() -> bool:
    """Whether ``jax.distributed.initialize()`` would find a cluster (SLURM, Open MPI, Kubernetes...).

    Public JAX only finds out by joining it; jddp must know first whether there
    is anything to join.
    """
    env = _cluster_env("cluster_detected")
    return any(not getattr(e, "opt_in_only_method", False) and e.is_env_present() for e in env._cluster_types)


def _mtls_kwargs(accepted: set[str] | None) -> dict[str, Any]:
    """The mTLS settings ``jax.distributed.initialize`` gives its service and clients (jax>=0.11.2: the
    ``jax_mtls_*`` / ``jax_distributed_verify_secure_credentials`` options), so that jddp's service speaks the same
    protocol as JAX's clients; {} where this jaxlib has no mTLS."""
    if not accepted or "mtls_cert_file" not in accepted:
        return {}
    get = _lookup("jax._src.distributed:_get_mtls_kwargs")
    if get is _MISSING:
        return {}
    kwargs = get(None, None, None, None, None)
    return {k: v for k, v in kwargs.items() if k in accepted}


def start_coordination_service(address: str, num_processes: int, heartbeat_timeout_s: int, shutdown_timeout_s: int):
    """Starts JAX's coordination service alone, in this process; returns it (``.shutdown()`` stops it).

    Public JAX starts the service only inside process 0's
    ``jax.distributed.initialize``, so the group's key-value store, barriers and
    heartbeats die with process 0 and JAX aborts every survivor from C++.
    ``jddp launch`` runs the service in a process of its own instead
    (``jddp.runtime.coordinator``), so losing process 0 is like losing any other.
    """
    start = _require(
        "start_coordination_service",
        "jax._src.lib:_jax.get_distributed_runtime_service",
        "jaxlib._jax:get_distributed_runtime_service",
    )
    accepted = _parameters(start)
    kwargs: dict[str, Any] = {"heartbeat_timeout": heartbeat_timeout_s, "shutdown_timeout": shutdown_timeout_s,
                              "recoverable": False}  # fmt: skip
    if accepted is not None:
        absent = set(kwargs) - accepted
        if absent:
            raise _missing(
                "start_coordination_service", [f"get_distributed_runtime_service({', '.join(sorted(absent))}=...)"]
            )
    kwargs.update(_mtls_kwargs(accepted))
    return start(address, num_processes, **kwargs)


def use_gloo_with_hostname(hostname: str) -> None:
    """Registers the CPU backend with gloo collectives that advertise ``hostname``.

    gloo advertises the address the machine's hostname resolves to; where that
    is 127.0.0.1 (many Debian hosts), peers on other hosts cannot connect. The
    public ``jax_cpu_collectives_implementation="gloo"`` has no way to give the
    address. Call after ``jax.distributed.initialize`` and before the backend starts.
    """
    make_gloo = _require(
        "use_gloo_with_hostname",
        "jax._src.lib:_jax.make_gloo_tcp_collectives",
        "jaxlib._jax:make_gloo_tcp_collectives",
    )
    register = _require("use_gloo_with_hostname", "jax._src.xla_bridge:register_backend_factory")
    make_cpu_client = _require("use_gloo_with_hostname", "jax._src.xla_bridge:make_cpu_client")
    if "collectives" not in (_parameters(make_cpu_client) or set()):
        raise _missing("use_gloo_with_hostname", ["jax._src.xla_bridge.make_cpu_client(collectives=...)"])
    if "hostname" not in (_parameters(make_gloo) or {"hostname"}):
        raise _missing("use_gloo_with_hostname", ["make_gloo_tcp_collectives(hostname=...)"])
    collectives = make_gloo(distributed_client=distributed_client(), hostname=hostname)
    register("cpu", functools.partial(make_cpu_client, collectives=collectives), priority=0, fail_quietly=False)


def batched_device_put() -> tuple[Callable, Callable] | None:
    """``(batched_device_put, ShapedArray)``: the C++ call ``jax.device_put`` ends in, or None if it moved.

    Through ``jax.device_put``'s Python layers a batch costs about 70 µs on 8
    simulated devices, straight through this call about 15 µs; on simulated
    devices that host time is taken from the training step (``packing.Transfer``).
    """
    put = _lookup("jax._src.lib:xla_client.batched_device_put", "jax._src.lib:_jax.batched_device_put")
    aval = _lookup("jax._src.core:ShapedArray")
    if put is _MISSING or aval is _MISSING:  # pragma: no cover - depends on the JAX version
        return None
    if not {"aval", "sharding", "xs", "devices", "committed"} <= (_parameters(put) or set()):  # pragma: no cover
        return None
    return put, aval


def varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over inside ``shard_map`` (``check_vma=True``).

    jax>=0.10 documents ``jax.typeof(x).manual_axis_type.varying`` (its CHANGELOG, 0.10.0: "The ``.vma`` property has
    been removed ... Use ``.manual_axis_type.varying``"); ``.mat`` is a private alias of it, ``.vma`` the
    pre-0.10 spelling.
    """
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
    if manual is not None and hasattr(manual, "varying"):
        return frozenset(manual.varying)
    vma = getattr(aval, "vma", None)
    if vma is not None:
        return frozenset(vma)
    raise _missing("varying_axes", ["jax.typeof(x).manual_axis_type.varying", ".mat.varying", ".vma"])


def make_cache_writes_atomic() -> bool:
    """Makes JAX's persistent compilation cache write each entry atomically (a temporary file, then a rename).

    JAX's ``LRUCache.put`` (jax 0.10 to 0.12, without a size limit) writes the entry in place with
    ``Path.write_bytes`` and never rewrites an entry that exists. A process killed in the middle of that write
    (a SIGKILL during the first compile is an ordinary way for a run to end) leaves a truncated entry that every
    later run fails to read, warns about, recompiles and cannot replace; two processes of one group writing the
    same entry can also let a third read it half written. Returns False (and changes nothing) when this JAX's
    cache is not the one expected. Leaves non-local caches (``etils.epath``, e.g. gs://) to JAX: ``os.replace`` is
    local only.
    """
    import os

    lru_cache = _lookup("jax._src.lru_cache")
    cls = getattr(lru_cache, "LRUCache", None) if lru_cache is not _MISSING else None
    if cls is None:
        return False
    if getattr(cls.put, "_jddp_atomic", False):
        return True
    suffix = getattr(lru_cache, "_CACHE_SUFFIX", None)
    if suffix is None or not callable(getattr(cls, "put", None)):
        return False
    if not {"key", "value"} <= (_parameters(cls.put) or {"key", "value"}):
        return False
    is_local = getattr(lru_cache, "_is_local_filesystem", None)
    original = cls.put

    def put(self, key: str, value: bytes) -> None:
        if not key or getattr(self, "eviction_enabled", True):
            return original(self, key, value)  # with a size limit JAX locks and evicts: leave that path as it is
        local = getattr(self, "_is_local", None)  # jax>=0.11.2 caches it; older: ask the module
        if local is None:
            local = is_local(str(self.path)) if callable(is_local) else True
        if not local:
            return original(self, key, value)
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


_CACHE_WRITE_WITH_CALLBACKS = [
    "cache_key",
    "compile_time_secs",
    "module_name",
    "backend",
    "executable",
    "host_callbacks",
]
_CACHE_WRITE = ["cache_key", "compile_time_secs", "module_name", "backend", "executable"]  # jax>=0.11.0


def cache_writes_from_every_process() -> bool:
    """Lets every process of a group write its compiled programs to the persistent compilation cache.

    JAX (0.10 to 0.12 at least) writes cache entries from process 0 only (``compiler._cache_write``: "contention for
    writes on some filesystems"). On CPU the other processes' programs have keys of their own (measured: process 1
    of 2 found none of its 10 programs after a run), so without this a restarted group waits for every other
    process to compile from scratch, and process 0's cache saves nothing. The replacement is JAX's own function
    without that one test; entries are written atomically (``make_cache_writes_atomic``), so processes that do share
    a key cannot corrupt it. jax 0.11.0 dropped its
    ``host_callbacks`` argument (such programs are now cacheable: the callbacks are part of the key and are passed to
    ``deserialize_executable``), so the replacement takes whichever of the two argument lists this JAX calls it with.
    Returns False (and changes nothing) when this JAX's function is neither.
    """
    import logging
    import warnings

    compiler = _lookup("jax._src.compiler")
    compilation_cache = _lookup("jax._src.compilation_cache")
    jax_config = _lookup("jax._src.config")
    if _MISSING in (compiler, compilation_cache, jax_config):
        return False
    original = getattr(compiler, "_cache_write", None)
    if original is None or getattr(original, "_jddp", False):
        return original is not None
    params = list(inspect.signature(original).parameters) if callable(original) else []
    put = getattr(compilation_cache, "put_executable_and_time", None)
    min_time = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    should_raise = getattr(compiler, "_should_raise_persistent_cache_error", None)
    if params not in (_CACHE_WRITE, _CACHE_WRITE_WITH_CALLBACKS):
        return False
    if put is None or min_time is None or should_raise is None:
        return False
    logger = logging.getLogger(compiler.__name__)

    def write(cache_key, compile_time_secs, module_name, backend, executable) -> None:
        if compile_time_secs < min_time.value:
            return
        try:
            put(cache_key, module_name, executable, backend, int(compile_time_secs))
        except Exception as ex:
            if should_raise(ex):
                raise
            logger.debug("cache write failed", exc_info=True)
            warnings.warn(
                f"Error writing persistent compilation cache entry for '{module_name}': {type(ex).__name__}: {ex}",
                stacklevel=3,
            )

    replacement: Callable[..., None]
    if params == _CACHE_WRITE_WITH_CALLBACKS:

        def _cache_write_with_callbacks(
            cache_key, compile_time_secs, module_name, backend, executable, host_callbacks
        ) -> None:
            if host_callbacks:
                return  # as JAX < 0.11: host callbacks are baked into the program
            write(cache_key, compile_time_secs, module_name, backend, executable)

        replacement = _cache_write_with_callbacks
    else:

        def _cache_write(cache_key, compile_time_secs, module_name, backend, executable) -> None:
            write(cache_key, compile_time_secs, module_name, backend, executable)

        replacement = _cache_write
    replacement._jddp = True  # type: ignore[attr-defined]
    compiler._cache_write = replacement
    return True


def ffi_sum_primitive(name: str, target: str, attributes):
    """A primitive that sums each of its operands over a mesh axis through the FFI custom call ``target`` (an
    external library's collective, such as MPI's allreduce of mpi4jax), for use inside ``shard_map``.

    ``bind(*operands, axis_name=..., **params)``: one call of ``target`` per operand, with side effects, each
    taking and returning a token chained from the previous call (made in the lowering), with the attributes
    ``attributes(aval, **params)``. Its abstract evaluation is ``lax.psum``'s: the results are invariant over
    ``axis_name``. Public JAX offers only ordered effects for such calls (mpi4jax's own primitives), which JAX
    refuses in any program of more than one device, as a multi-process step is; the token chain keeps the calls
    in one order on every process instead.
    """
    Primitive = _require("ffi_sum_primitive", "jax.extend.core:Primitive", "jax._src.core:Primitive")
    NamedAxisEffect = _require("ffi_sum_primitive", "jax._src.core:NamedAxisEffect")
    abstract_token = _require("ffi_sum_primitive", "jax._src.core:abstract_token")
    register_lowering = _require(
        "ffi_sum_primitive", "jax.interpreters.mlir:register_lowering", "jax._src.interpreters.mlir:register_lowering"
    )
    create_token = _require(
        "ffi_sum_primitive",
        "jax.extend.mlir.dialects.stablehlo:create_token",  # public from jax 0.12
        "jax._src.lib.mlir.dialects.hlo:create_token",
    )
    ffi_lowering = _require("ffi_sum_primitive", "jax.ffi:ffi_lowering")

    def manual(aval):
        mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
        if mat is None or not callable(getattr(mat, "update", None)):
            raise _missing("ffi_sum_primitive", ["ShapedArray.manual_axis_type.update(varying=...)"])
        return mat

    p = Primitive(name)
    p.multiple_results = True

    def abstract_eval(*avals, axis_name, **params):
        del params
        out = []
        for aval in avals:
            mat = manual(aval)
            varying = frozenset(a for a in mat.varying if a != axis_name)
            out.append(aval.update(manual_axis_type=mat.update(varying=varying)))
        return out, {NamedAxisEffect(axis_name)}

    p.def_effectful_abstract_eval(abstract_eval)

    def lowering(ctx, *args, axis_name, **params):
        del axis_name
        call = ffi_lowering(target, has_side_effect=True)
        token = create_token()
        results = []
        for x, aval_in, aval_out in zip(args, ctx.avals_in, ctx.avals_out, strict=True):
            one = ctx.replace(avals_in=(aval_in, abstract_token), avals_out=(aval_out, abstract_token))
            result, token = call(one, x, token, **attributes(aval_in, **params))
            results.append(result)
        return results

    register_lowering(p, lowering, platform="cpu")
    return p


def scan_counts(params) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's params (its operands are consts, carry, xs).

    jax < 0.11 gives them as ``params["num_consts"]``/``["num_carry"]``; jax 0.11.0 replaced both with ``ft_in``, a
    ``jax._src.flattree.FlatTree`` packing (consts, carry, xs) (jax/_src/lax/control_flow/loops.py ``scan_p.bind``).
    """
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    ft_in = params.get("ft_in")
    unpack = getattr(ft_in, "unpack", None)
    if callable(unpack):
        parts: Any = unpack()
        if len(parts) == 3:
            return len(parts[0]), len(parts[1])
    raise _missing("scan_counts", ['scan params "num_consts"/"num_carry"', 'scan params "ft_in".unpack()'])
