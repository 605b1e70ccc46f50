"""Canaries for jddp.runtime.jax_internals: each fails naming the private JAX API that a JAX upgrade moved."""

from __future__ import annotations

import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jddp
from jddp import net
from jddp.runtime import jax_internals


def moved(function: str, what: str) -> str:
    return (
        f"jax {jax.__version__}: `jddp.runtime.jax_internals.{function}` relies on {what}, which this JAX does not "
        "have any more. Find its new home in JAX's source and update that function (and the range `jax<0.13` in "
        "pyproject.toml)."
    )


def private(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def test_backend_started():
    jax.devices()
    assert private("jax._src.xla_bridge", "backends_are_initialized") is not None, moved(
        "backend_started", "jax._src.xla_bridge.backends_are_initialized"
    )
    assert jax_internals.backend_started() is True


def test_distributed_client_and_coordinator_address():
    state = private("jax._src.distributed", "global_state")
    assert state is not None and hasattr(state, "client"), moved("distributed_client", "distributed.global_state")
    assert hasattr(state, "coordinator_address"), moved("coordinator_address", "global_state.coordinator_address")
    # pytest's process never joins a group (tests/multiprocess.py runs groups in their own processes).
    assert jax_internals.distributed_client() is None and jax_internals.coordinator_address() is None


def test_cluster_detected():
    envs = private("jax._src.clusters", "ClusterEnv")
    assert envs is not None and envs._cluster_types, moved("cluster_detected", "clusters.ClusterEnv._cluster_types")
    for env in envs._cluster_types:
        assert hasattr(env, "opt_in_only_method") and callable(env.is_env_present), moved(
            "cluster_detected", f"{env.__name__}.opt_in_only_method / is_env_present"
        )
    assert jax_internals.cluster_detected() is False  # no SLURM, Open MPI or Kubernetes here


def test_detect_cluster(monkeypatch):
    assert jax_internals.detect_cluster(1) == (None, None, None, None)  # no cluster here
    for name, value in {
        "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[003-004]", "SLURM_NTASKS": "4", "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0", "JAX_COORDINATOR_PORT": "1234",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    found = jax_internals.detect_cluster(1)
    assert found == ("node003:1234", 4, 2, [0]), moved(
        "detect_cluster", "ClusterEnv.auto_detect_unset_distributed_params"
    )


def test_use_gloo_with_hostname():
    """Only looked up: registering a backend in pytest's process would replace its CPU client."""
    jax_lib = private("jax._src.lib", "_jax")
    assert jax_lib is not None and callable(getattr(jax_lib, "make_gloo_tcp_collectives", None)), moved(
        "use_gloo_with_hostname", "jax._src.lib._jax.make_gloo_tcp_collectives"
    )
    for name in ("register_backend_factory", "make_cpu_client"):
        assert callable(private("jax._src.xla_bridge", name)), moved("use_gloo_with_hostname", f"xla_bridge.{name}")
    # The two-host test (tests/test_two_hosts.py) is where the registration itself is exercised.


def test_start_coordination_service():
    """A service alone, with no client: it listens on the port it was given, and shuts down."""
    assert callable(getattr(private("jax._src.lib", "_jax"), "get_distributed_runtime_service", None)), moved(
        "start_coordination_service", "jax._src.lib._jax.get_distributed_runtime_service"
    )
    port = net.free_port()
    service = jax_internals.start_coordination_service(f"127.0.0.1:{port}", 2, 60, 5)
    try:
        with pytest.raises(OSError, match="already in use"):
            net.check_port_free("127.0.0.1", port)
    finally:
        service.shutdown()
    net.check_port_free("127.0.0.1", port)


def test_batched_device_put_equals_device_put():
    direct = jax_internals.batched_device_put()
    assert direct is not None, moved("batched_device_put", "jax._src.lib.xla_client.batched_device_put")
    put, aval = direct
    sharding = jddp.batch_sharding(jddp.data_mesh())
    data = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    devices = list(sharding.addressable_devices_indices_map(data.shape))
    rows = [data[i : i + 1] for i in range(8)]
    got = put(aval(data.shape, data.dtype), sharding, rows, devices, True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.device_put(data, sharding)))


def test_varying_axes():
    mesh = jddp.data_mesh()

    def body(x, w):
        return jnp.stack([len(jax_internals.varying_axes(x)), len(jax_internals.varying_axes(w))])[None]

    try:
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
        counts = np.asarray(f(np.ones(8, np.float32), np.float32(1)))
    except AttributeError as error:
        pytest.fail(moved("varying_axes", f"jax.typeof(x).mat.varying ({error})"))
    assert (counts == [[1, 0]] * 8).all()  # the batch varies over "data"; a replicated weight does not


def test_make_cache_writes_atomic():
    assert jax_internals.make_cache_writes_atomic(), "jax._src.lru_cache.LRUCache.put moved or changed"
    # the behaviour: tests/test_compile_cache.py::test_cache_entries_are_written_whole_or_not_at_all


def test_cache_writes_from_every_process():
    assert jax_internals.cache_writes_from_every_process(), (
        "jax._src.compiler._cache_write moved or changed its arguments; see its docstring for why jddp replaces it"
    )
    # the behaviour: tests/test_compile_cache.py::test_a_second_run_reaches_its_first_step_without_compiling[2]


class FlatTree:
    """A scan's ``ft_in`` as jax 0.11 and later give it: ``unpack()`` to (consts, carry, xs)."""

    def __init__(self, *parts) -> None:
        self.parts = parts

    def unpack(self):
        return self.parts


def test_scan_counts_reads_both_spellings_of_a_scan_and_names_the_version_when_neither_fits():
    """jax 0.10's scan params (num_consts, num_carry) and 0.11's FlatTree (ft_in), as the review found them; and the
    live one of this JAX, from a traced scan."""
    assert jax_internals.scan_counts({"num_consts": 2, "num_carry": 3, "jaxpr": None}) == (2, 3)
    assert jax_internals.scan_counts({"ft_in": FlatTree((1, 2), (3,), (4, 5, 6)), "ft_out": None}) == (2, 1)
    with pytest.raises(jax_internals.JaxInternalsError, match=rf"jax {jax.__version__} .*scan_counts found none"):
        jax_internals.scan_counts({"length": 4})
    c = jnp.ones(3)
    jaxpr = jax.make_jaxpr(lambda x: jax.lax.scan(lambda h, y: (h + y * c, h), jnp.zeros(3), x))(jnp.ones((4, 3)))
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert jax_internals.scan_counts(eqn.params) == (1, 1), moved("scan_counts", "the scan's params")


def test_a_private_api_that_moved_is_named_with_the_jax_version():
    with pytest.raises(jax_internals.JaxInternalsError, match=rf"jax {jax.__version__} \(jaxlib .*\): .*f found none"):
        jax_internals._require("f", "jax._src.no_such_module:thing", "jax._src.xla_bridge:no_such_function")
    assert jax_internals._lookup("jax._src.no_such_module:x", "jax._src.xla_bridge:backends_are_initialized") is (
        private("jax._src.xla_bridge", "backends_are_initialized")
    )


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (
            "f(address: str, num_nodes: int, heartbeat_timeout: int | None = None, shutdown_timeout=None) -> S",
            {"address", "num_nodes", "heartbeat_timeout", "shutdown_timeout"},
        ),
        ("g(a: dict[str, tuple[int, int]] = {}, *, b: Callable[[int, str], None], **kw) -> None", {"a", "b", "kw"}),
    ],
    ids=["plain", "nested-brackets"],
)
def test_the_parameters_of_a_nanobind_function_are_read_from_its_signature_text(text, names):
    """``inspect.signature`` refuses nanobind functions (jaxlib's): their names come from ``__nb_signature__``."""

    class Nanobind:
        __nb_signature__ = ((text, None, None),)
        __signature__ = property(lambda self: (_ for _ in ()).throw(ValueError("not supported by signature")))

        def __call__(self, *args, **kwargs):
            return None

    assert jax_internals._parameters(Nanobind()) == names


def test_cache_write_replacements_follow_either_signature(monkeypatch):
    """jax 0.10's ``_cache_write`` had a host_callbacks argument, 0.11's has not: the replacement takes the one it
    finds, and an unknown one is left alone (False)."""
    compiler = importlib.import_module("jax._src.compiler")

    def five(cache_key, compile_time_secs, module_name, backend, executable):
        return None

    def six(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks):
        return None

    def other(cache_key, module_name):
        return None

    for fn, installed in ((five, True), (six, True), (other, False)):
        monkeypatch.setattr(compiler, "_cache_write", fn)
        assert jax_internals.cache_writes_from_every_process() is installed, fn.__name__
        if installed:
            assert list(inspect.signature(compiler._cache_write).parameters) == list(inspect.signature(fn).parameters)
