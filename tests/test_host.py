"""Host collectives over 2 and 3 real processes (tests/workers/host_collectives.py), against NumPy: every
process gets the same result, errors are raised on every process and name the process at fault, and a
process that does not call is named by the others' timeout."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

import jddp
from jddp.runtime import host
from tests import multiprocess

WORKER = str(multiprocess.WORKERS / "host_collectives.py")


def results(output: str) -> dict[str, dict]:
    lines = [json.loads(line[len("RESULT ") :]) for line in output.splitlines() if line.startswith("RESULT ")]
    return {r["name"]: r for r in lines}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}-processes")
def run(request):
    n = request.param
    codes, outputs = multiprocess.collect(multiprocess.spawn(WORKER, n, 1), timeout=240)
    assert codes == [0] * n, multiprocess.show(codes, outputs)
    return n, [results(o) for o in outputs]


def array(result: dict) -> np.ndarray:
    return np.array(result["value"]["array"], dtype=result["value"]["dtype"])


@pytest.mark.multiprocess
def test_every_process_gets_the_numpy_result(run):
    n, per_process = run
    values = np.stack([np.random.default_rng(i).normal(size=(3, 2)).astype(np.float32) for i in range(n)])
    expected = {
        "sum": values.sum(axis=0),
        "mean": (values.sum(axis=0, dtype=np.float64) / n).astype(np.float32),
        "max": values.max(axis=0),
        "min": values.min(axis=0),
    }
    for r in per_process:
        assert r["gather"]["value"] == [{"process": i, "items": list(range(i))} for i in range(n)]
        assert r["sum_int"]["value"] == n * (n + 1) // 2 and r["sum_int"]["type"] == "int"
        for op, reference in expected.items():
            got = array(r[f"{op}_array"])
            assert got.dtype == np.float32 and got.tobytes() == reference.tobytes(), (op, got, reference)
        assert r["mean_int"]["value"] == pytest.approx((n - 1) / 2) and r["mean_int"]["type"] == "float"
        assert r["flag"]["value"] is True
        assert r["broadcast"]["value"] == {"vocab": ["a", "b", 0]}
        assert r["big"]["value"] == [8 << 20] * n
        assert r["after"]["value"] == n  # the group goes on after the errors below


@pytest.mark.multiprocess
def test_a_bad_value_or_call_is_an_error_on_every_process_naming_the_process(run):
    n, per_process = run
    for r in per_process:
        assert r["too_big"]["error"] == "ValueError"
        size = len(pickle.dumps(("host_all_gather", bytes(host.MAX_BYTES + 1)), protocol=pickle.HIGHEST_PROTOCOL))
        assert (
            f"process 1's value is {size} bytes pickled, more than MAX_BYTES={host.MAX_BYTES}"
            in (r["too_big"]["message"])
        )
        assert r["unpicklable"]["error"] == "ValueError"
        assert f"process {n - 1}'s value of type function does not pickle" in r["unpicklable"]["message"]
        shapes = ", ".join(f"process {i}: ({i + 1},)" for i in range(n))
        assert r["shapes"] == {
            "name": "shapes",
            "error": "ValueError",
            "message": f"host_all_reduce: every process must give the same shape, got {shapes}.",
        }
        assert r["mismatch"]["error"] == "RuntimeError"
        assert "process 1: host_broadcast" in r["mismatch"]["message"]
        assert "process 0: host_all_gather" in r["mismatch"]["message"]


@pytest.mark.multiprocess
def test_a_process_that_does_not_call_is_named_by_the_others_timeout(run):
    n, per_process = run
    for r in per_process[:-1]:
        assert r["timeout"]["error"] == "TimeoutError"
        assert (
            f"timed out after 3 s on process {per_process.index(r)}: process(es) [{n - 1}] did not call it"
            in (r["timeout"]["message"])
        )
    assert "timeout" not in per_process[-1]


def test_one_process_returns_its_own_values_and_checks_arguments():
    values = np.arange(6.0).reshape(2, 3)
    assert jddp.host_all_gather({"a": 1}) == [{"a": 1}]
    assert jddp.host_broadcast("x") == "x"
    assert jddp.host_all_reduce(values, op="max").tobytes() == values.tobytes()
    assert jddp.host_all_reduce(2) == 2 and isinstance(jddp.host_all_reduce(2.5, op="mean"), float)
    with pytest.raises(ValueError, match=r"op='avg' must be one of \('sum', 'mean', 'max', 'min'\)"):
        jddp.host_all_reduce(1, op="avg")  # pyright: ignore[reportArgumentType]  # the mistake under test
    with pytest.raises(ValueError, match=r"must be a number or a numeric NumPy array, got str .*use host_all_gather"):
        jddp.host_all_reduce("3")
    with pytest.raises(ValueError, match=r"timeout_s=0 must be a positive number of seconds"):
        jddp.host_all_gather(1, timeout_s=0)
