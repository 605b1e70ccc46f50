"""benchmarks/control_plane_real.py's counting inside a jddp process: ``install`` wraps the client jddp takes from
``jax_internals.distributed_client`` so that every call of ``jddp.barrier`` and ``jddp.host_all_gather`` is
counted, the watchdog's announce of the call included, and the watchdog's own calls apart. One process against a
real coordination service of one task (no launch, no JAX devices)."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading

import pytest

import jddp
from benchmarks import control_plane, control_plane_real
from jddp.runtime import coordinator, distributed, host, jax_internals, process_group, progress, watchdog


@pytest.fixture(scope="module")
def client():
    """A client of a coordination service of one task, connected as task 0."""
    from jax._src.lib import _jax  # pyright: ignore[reportPrivateImportUsage]  # jax.distributed.initialize's client

    address = f"127.0.0.1:{control_plane.free_port()}"
    service = subprocess.Popen(
        [sys.executable, "-u", "-m", "jddp.runtime.coordinator", address, "1", "30", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert service.stdout is not None
        line = service.stdout.readline().decode()
        assert line.startswith(coordinator.READY), line
        c = _jax.get_distributed_runtime_client(address, 0, init_timeout=60, heartbeat_timeout=30)
        c.connect()
        yield c
        c.shutdown()
    finally:
        service.terminate()
        service.wait(timeout=30)
        if service.stdout is not None:
            service.stdout.close()


def test_every_call_of_a_barrier_and_an_all_gather_is_counted(client, monkeypatch):
    monkeypatch.setattr(jax_internals, "distributed_client", lambda: client)  # JAX's client, as after the join
    control_plane_real.install()  # what the benchmark's worker does before jddp.initialize
    wrapped = jax_internals.distributed_client()
    counted = control_plane_real.split()
    assert wrapped is counted and jax_internals.distributed_client() is counted and counted.client is client
    # a group of one, as jddp.initialize leaves it; its watchdog built with the client it asks for (not started:
    # its announce, which the collective calls make, is what is tested)
    monkeypatch.setattr(process_group, "_group", process_group.ProcessGroup("x", 1, 0, 30.0))
    monkeypatch.setattr(distributed, "_barrier_counts", {})
    monkeypatch.setattr(host, "_calls", 0)
    dog = watchdog.Watchdog(jax_internals.distributed_client(), 0, 1, None, 30.0)
    monkeypatch.setattr(progress, "ANNOUNCE", dog.announce)

    announced = []  # the reference: what the service holds after each call, read past the counting

    def drained() -> dict:
        dog.call(lambda: None, timeout_s=60)  # the watchdog's key-value thread is done with the announce
        announced.append(dict(client.key_value_dir_get(watchdog.ALIVE_PREFIX)))
        return control_plane_real.snapshot(counted.main)

    s0 = drained()
    jddp.barrier("counted")
    s1 = drained()
    jddp.host_all_gather({"a": 1})
    s2 = drained()
    jddp.host_all_gather({"a": 2})
    s3 = drained()
    assert list(announced[1]) == ["jddp/alive/0"]  # the announce's heartbeat value, this process's only key there
    assert client.key_value_try_get("jddp/barrier/counted/1/0") == "1"
    data = dict(client.key_value_dir_get_bytes("jddp/host/2/"))["jddp/host/2/0"]
    assert pickle.loads(data) == ("host_all_gather", {"a": 2})

    barrier = control_plane_real.since(s0, s1)
    # the announce (a key_value_set of the heartbeat value), the arrival's key_value_set, the wait
    assert barrier["by_call"] == {"key_value_set": 2, "wait_at_barrier": 1}

    def announce_bytes(k: int) -> int:  # the k-th call's announce: its key, value and overwrite flag (8)
        return len(b"jddp/alive/0") + len(announced[k]["jddp/alive/0"].encode()) + 8

    barrier_bytes = len(b"jddp/barrier/counted/1/0") + 1 + 8 + len(b"jddp/barrier/counted/1") + 8  # + the timeout
    assert barrier["bytes"] == announce_bytes(1) + barrier_bytes
    first = control_plane_real.since(s1, s2)
    assert first["by_call"] == {
        "key_value_set": 1,
        "key_value_set_bytes": 1,
        "wait_at_barrier": 1,
        "key_value_dir_get_bytes": 1,
    }
    assert first["values"] == 1
    second = control_plane_real.since(s2, s3)  # and the previous call's key deleted
    assert second["by_call"] == {**first["by_call"], "key_value_delete": 1}
    sent = len(b"jddp/host/2/0") + len(data) + len(b"jddp/host/2") + 8 + len(b"jddp/host/2/")
    received = len(b"jddp/host/2/0") + len(data)
    deleted = len(b"jddp/host/1/0")
    assert second["bytes"] == announce_bytes(3) + sent + received + deleted

    # A call asked for by another thread (the watchdog's rounds) counts apart, not with the main thread's.
    b0 = control_plane_real.snapshot(counted.background)
    other = threading.Thread(target=lambda: dog.call(dog.client.key_value_set, dog.key, "1|0:0:", allow_overwrite=True))
    other.start()
    other.join()
    assert control_plane_real.since(b0, control_plane_real.snapshot(counted.background))["by_call"] == {
        "key_value_set": 1
    }
    assert control_plane_real.since(s3, drained())["requests"] == 0
