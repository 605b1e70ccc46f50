"""The benchmark harness (benchmarks/harness.py) and the one command (``python -m benchmarks``): every benchmark
listed, the pairing, the bootstrap and the busy check right on synthetic inputs, and one JSON schema written."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import __main__ as command
from benchmarks import harness
from tests import multiprocess

ROOT = multiprocess.ROOT
DEFINES_MAIN = re.compile(r"^def main\(", re.M)


def benchmark_files() -> dict[str, str]:
    """Every module of benchmarks/ (and package's run.py) that defines ``main``, by the name ``--list`` gives it."""
    found = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        if path.stem in ("__main__", "__init__") or not DEFINES_MAIN.search(path.read_text()):
            continue
        found[path.parent.name if path.stem == "run" else path.stem] = str(path.relative_to(ROOT))
    return found


def test_list_names_every_benchmark_with_its_question(capsys):
    assert command.main(["--list"]) == 0
    listed = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert set(listed) == set(benchmark_files()), (sorted(listed), benchmark_files())
    for name, asks in listed.items():
        assert "?" in asks, f"{benchmark_files()[name]}: its docstring's first line should be its question: {asks!r}"


def test_all_runs_only_benchmarks_that_exist():
    names = set(benchmark_files()) | {"jddp"}
    assert {name for _, name, _, _ in command.ALL} <= names
    labels = [label for label, *_ in command.ALL]
    assert len(labels) == len(set(labels))


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        (harness.abba, ["a", "b", "b", "a", "a", "b"]),
        (harness.permuted, ["a", "b", "b", "a", "a", "b"]),
    ],
    ids=["abba", "permuted-two"],
)
def test_pairing_orders(order, expected):
    assert [name for _, name in order(["a", "b"], 3)] == expected


def test_permuted_runs_every_order_of_three_arms():
    rounds = [tuple(n for r, n in harness.permuted(["a", "b", "c"], 6) if r == i) for i in range(6)]
    assert sorted(rounds) == sorted(__import__("itertools").permutations("abc"))


def test_interleave_collects_each_arms_values_and_drops_failed_runs():
    calls = []

    def arm(name, value):
        return lambda: calls.append(name) or value

    out = harness.interleave({"a": arm("a", 1.0), "b": arm("b", None)}, 2)
    assert calls == ["a", "b", "b", "a"]
    assert out == {"a": [1.0, 1.0], "b": []}


def test_compare_matches_numpy():
    rng = np.random.default_rng(1)
    b = rng.uniform(1.0, 2.0, 41)
    a = b * rng.normal(1.1, 0.05, 41)
    figures = harness.compare(list(a), list(b))
    assert figures["median_a"] == pytest.approx(np.median(a))
    assert figures["ratio_of_medians"] == pytest.approx(np.median(a) / np.median(b))
    assert figures["median_pair_ratio"] == pytest.approx(np.median(a / b))
    low, high = figures["ci95"]
    assert low < np.median(a / b) < high


def test_bootstrap_median_interval_is_the_medians_standard_error():
    """For normal samples the median's standard error is sqrt(pi/2) sigma / sqrt(n): the bootstrap's 95% interval
    is about +-1.96 of it."""
    values = np.random.default_rng(2).normal(10.0, 1.0, 400)
    low, high = harness.bootstrap_median(list(values))
    half = 1.96 * np.sqrt(np.pi / 2) / np.sqrt(len(values))
    assert (high - low) / 2 == pytest.approx(half, rel=0.3)
    assert low < np.median(values) < high


def test_bootstrap_of_constant_ratios_is_that_ratio():
    b = list(np.random.default_rng(3).uniform(1, 5, 30))
    assert harness.bootstrap_median([1.25] * 30) == (1.25, 1.25)
    assert harness.bootstrap_total([2 * x for x in b], b) == pytest.approx((2.0, 2.0))


@pytest.mark.parametrize(("peak", "cores", "busy"), [(1.5, 2, False), (2.0, 2, False), (2.01, 2, True)],
                         ids=["quiet", "at-the-cores", "above"])  # fmt: skip
def test_busy_is_a_load_above_the_core_count(peak, cores, busy):
    assert harness.busy({"max": peak}, cores) is busy


def test_load_sampler_records_start_samples_and_end(monkeypatch):
    loads = iter([(1.0, 1.0, 1.0), (3.0, 1.0, 1.0), (0.5, 1.0, 1.0)] + [(0.5, 1.0, 1.0)] * 100)
    monkeypatch.setattr(harness.os, "getloadavg", lambda: next(loads))
    sampler = harness.LoadSampler(every_s=0.01).start()
    while not sampler.samples:
        pass
    record = sampler.stop()
    assert record["start"] == [1.0, 1.0, 1.0] and record["samples"][0][1] == 3.0
    assert record["max"] == 3.0 and record["end"][0] == 0.5


def fake_benchmark(monkeypatch, load: float):
    """``harness.run`` on a benchmark that returns its arguments, the load average pinned to ``load``."""
    monkeypatch.setattr(harness.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(harness.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(harness, "commit", lambda: "0000000")  # no git process in the fast tier
    parser = harness.argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    return lambda argv: harness.run("benchmarks.fake", '"""Is it fake?"""', parser, vars, argv, {"steps": 2})


def test_a_record_has_the_one_schema_and_quick_sizes(monkeypatch, tmp_path, capsys):
    out = tmp_path / "fake.json"
    fake_benchmark(monkeypatch, 0.5)(["--quick", "--json", str(out)])
    record = json.loads(out.read_text())
    assert tuple(record) == harness.SCHEMA
    assert record["benchmark"] == "fake" and record["busy"] is False
    assert record["results"]["steps"] == 2  # --quick's size
    assert record["machine"]["cores"] == 2 and "python" in record["machine"]["versions"]
    assert record["load"]["cores"] == record["machine"]["cores"]  # the load is read against the cores
    fake_benchmark(monkeypatch, 0.5)(["--quick", "--steps", "7", "--json", str(out)])
    assert json.loads(out.read_text())["results"]["steps"] == 7  # a flag given wins over --quick


def test_a_busy_machine_is_warned_and_recorded_or_refused(monkeypatch, tmp_path, capsys):
    out = tmp_path / "fake.json"
    fake_benchmark(monkeypatch, 5.0)(["--json", str(out)])
    assert "WARNING" in capsys.readouterr().out
    assert json.loads(out.read_text())["busy"] is True
    out.unlink()
    with pytest.raises(SystemExit, match=str(harness.NOT_QUIET_EXIT)):
        fake_benchmark(monkeypatch, 5.0)(["--require-quiet", "--json", str(out)])
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["replica_check", "step_overhead", "zero"])
def test_quick_benchmarks_write_the_schema(name, tmp_path):
    """Three of the cheapest benchmarks, ``--quick``, as ``python -m benchmarks NAME`` runs them."""
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, "-m", "benchmarks", name, "--quick", "--json", str(out)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert tuple(record) == harness.SCHEMA
    assert record["benchmark"] == name and "?" in record["question"]
    assert record["results"], record


@pytest.mark.slow  # reads the standard library twice: seconds
def test_the_benchmarks_lm_is_the_lm_example():
    """benchmarks/lm.py copies the LM example's model, loss and windows (benchmarks never import the examples): the
    same parameters from the same seed, the same loss on the same batch, the same training windows."""
    import jax
    import numpy as np
    from flax import nnx

    import jddp
    from benchmarks import lm
    from examples.lm import data, model, train

    config = lm.Config()
    sizes = {"d_model": config.d_model, "heads": config.heads, "layers": config.layers, "mlp_ratio": config.mlp_ratio}
    theirs = model.Transformer(seq_len=config.seq_len, **sizes, rngs=nnx.Rngs(config.seed))
    mine = lm.Transformer(config, rngs=nnx.Rngs(config.seed))
    for a, b in zip(jax.tree.leaves(nnx.state(mine)), jax.tree.leaves(nnx.state(theirs)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    windows = lm.train_windows(config)
    expected = data.load(config.seq_len, test_modulus=config.test_modulus)["train"]
    assert all(np.array_equal(windows[k], expected[k]) for k in ("tokens", "weights"))
    batch = {k: v[:8] for k, v in windows.items()}
    ours, _ = lm.loss(mine, batch, jax.random.key(0))
    example, _ = train.language_model_metrics(train.forward(theirs, batch), batch)
    assert isinstance(ours, jddp.Weighted) and float(ours.total) == float(example.total)
