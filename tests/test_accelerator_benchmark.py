"""``python -m benchmarks accelerator`` at its small size on simulated CPU devices: the one command that proves
jddp on a device runs here, its record says jddp equals plain jit within the tolerance on every model, and it fails
(exit non-zero, naming the tolerance) when the difference is above it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import multiprocess


def run(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "accelerator.json"
    command = [sys.executable, "-m", "benchmarks", "accelerator", "--quick", "--devices", "4", "--json", str(out)]
    done = subprocess.run(
        [*command, *extra], capture_output=True, text=True, timeout=600, cwd=multiprocess.ROOT,
        env=multiprocess.environment(),
    )  # fmt: skip
    return done, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_accelerator_benchmark_finds_jddp_equal_to_plain_jit_and_says_its_figures(tmp_path):
    done, record = run(tmp_path, "--models", "mlp,lm")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert record is not None and record["benchmark"] == "accelerator"
    results = record["results"]
    assert results["devices"] == 4 and results["platform"] == "cpu"
    for name in ("mlp", "lm"):
        found = results["models"][name]
        assert found["equal"] and 0 <= found["max_diff_vs_plain_jit"] <= 1e-6, found["max_diff_vs_plain_jit"]
        assert found["jddp_over_hand"]["median_pair_ratio"] > 0 and found["snapshot_over_step"]["median_a"] > 0
        zero1, replicated = found["bytes_per_device"]["zero1"], found["bytes_per_device"]["replicated"]
        assert zero1["compiled"] < replicated["compiled"]  # Adam's moments split over the devices
    assert "max |jddp - jit|" in done.stdout and "mlp" in done.stdout


@pytest.mark.multiprocess
def test_the_accelerator_benchmark_fails_when_jddp_differs_from_plain_jit_beyond_the_tolerance(tmp_path):
    done, record = run(tmp_path, "--models", "mlp", "--tolerance", "1e-12")
    assert done.returncode != 0 and record is None
    assert "differs from plain jit by more than 1e-12" in done.stderr
