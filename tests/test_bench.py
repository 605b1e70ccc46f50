"""``jddp bench``: a short real run whose figures must agree with each other, and its input errors."""

from __future__ import annotations

import functools
import json
import re

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.benchmark import models, worker
from jddp.cli import bench
from jddp.cli import main as cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_figures_are_consistent(tmp_path, capsys):
    out = tmp_path / "mlp"
    argv = ["bench", "--devices", "1,2", "--steps", "5", "--rounds", "2", "--warmup", "1", "--output", str(out)]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    report = json.loads(out.with_suffix(".json").read_text())
    rows = {(r["processes"], r["devices"]): r for r in report["rows"]}
    assert set(rows) == {(1, 1), (1, 2)}
    (base_raw,) = [r for r in report["raw"] if (r["processes"], r["devices"]) == (1, 1)]
    for raw in report["raw"]:
        # Every figure recomputed from the raw timings with NumPy (an independent median and percentile).
        row = rows[raw["processes"], raw["devices"]]
        assert len(raw["jddp_ms"]) == 2 and len(raw["latency_ms"]) == 2 * 5
        assert row["global_batch"] == 64 * row["devices"]
        step, local, hand = (float(np.median(raw[k])) for k in ("jddp_ms", "local_ms", "hand_ms"))
        assert row["step_ms"] == pytest.approx(step)
        assert row["throughput"] == pytest.approx(64 * row["devices"] / step * 1e3)
        assert row["speedup"] == pytest.approx(row["throughput"] / (64 / float(np.median(base_raw["jddp_ms"])) * 1e3))
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["devices"])
        assert row["latency_median_ms"] == pytest.approx(float(np.median(raw["latency_ms"])))
        assert row["latency_p90_ms"] == pytest.approx(float(np.percentile(raw["latency_ms"], 90)))
        assert row["allreduce_ms"] == pytest.approx(max(0.0, step - local))
        assert row["allreduce_share"] == pytest.approx(max(0.0, step - local) / step)
        assert row["overhead_vs_hand"] == pytest.approx(step / hand)
        assert row["compile_s"] == raw["compile_s"] > 0
        assert f"{row['throughput']:.0f}" in table
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model": "rnn"}, r"`model` must be one of .* model='rnn'"),
        ({"devices": (2, 4)}, r"`devices` must include 1"),
        ({"devices": (0, 1)}, r"`devices` must be an int >= 1, got devices=0. Give a list"),
        ({"processes": ()}, r"`processes` must be a non-empty list of ints >= 1, got processes=\(\)"),
        ({"devices": (1,), "processes": (2,)}, r"No process count in processes=\(2,\) divides"),
        ({"steps": 0}, r"`steps` must be an int >= 1, got steps=0"),
        ({"warmup": -1}, r"`warmup` must be an int >= 0, got warmup=-1"),
        ({"repeats": 0}, r"`repeats` must be an int >= 1, got repeats=0"),
    ],
    ids=["model", "no-baseline", "zero-devices", "no-processes", "indivisible", "steps", "warmup", "repeats"],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench.BenchConfig(**kwargs)


def test_configurations_skip_indivisible_pairs():
    config = bench.BenchConfig(devices=(1, 2, 4, 8), processes=(1, 2))
    assert config.configurations() == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (2, 8)]
    assert bench.BenchConfig(devices=(1, 2), processes=(2,)).configurations() == [(1, 1), (2, 2)]


def test_repeats_pool_timings():
    def result(ms, compile_s):
        timings = {"jddp_ms": [ms], "hand_ms": [ms], "local_ms": [ms], "latency_ms": [ms, ms]}
        return {"processes": 1, "devices": 1, "global_batch": 64, "grad_bytes": 4, **timings,
                "compile_s": compile_s, "hand_compile_s": compile_s}  # fmt: skip

    merged = bench._merge([result(1.0, 3.0), result(2.0, 5.0), result(4.0, 4.0)])
    assert merged["jddp_ms"] == [1.0, 2.0, 4.0] and merged["latency_ms"] == [1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert merged["compile_s"] == 4.0 and merged["global_batch"] == 64
    assert bench.summarize([merged])[0]["step_ms"] == 2.0


def _table(configurations):
    """``format_table`` of made-up timings for these ``(processes, devices)``: its column names, its rows (cells
    split where two spaces part them), and the lines after the rows (the legend)."""
    raw = [{"processes": p, "devices": d, "global_batch": 64 * d, "jddp_ms": [2.0 + d], "hand_ms": [1.9 + d],
            "local_ms": [1.5 + d / 2], "latency_ms": [2.5 + d, 3.0 + d], "compile_s": 1.25, "grad_bytes": 4}
           for p, d in configurations]  # fmt: skip
    rows = bench.summarize(raw)
    lines = bench.format_table(rows).splitlines()
    (at,) = [i for i, line in enumerate(lines) if line.split()[:2] == ["proc", "dev"]]
    split = functools.partial(re.split, r"\s{2,}")
    columns = split(lines[at].strip())
    cells = [split(line.strip()) for line in lines[at + 1 : at + 1 + len(rows)]]
    return columns, cells, lines[at + 1 + len(rows) :]


def test_the_table_explains_every_column_it_prints_and_gives_every_figure_its_unit():
    columns, cells, legend = _table([(1, 1), (1, 2), (2, 2), (2, 8)])
    assert len(columns) >= 8 and all(len(row) == len(columns) for row in cells)
    for name in columns:  # each column's name opens a line of the legend, which says what it is
        assert any(re.match(rf"\s*{re.escape(name)}(, [^:]+)?: \S", line) for line in legend), (name, legend)
    unit = re.compile(r"^\d[\d.]* ?(examples/s|x|%|ms|s)\*?$")
    for row in cells:  # a count in the process and device columns; every other figure with its unit
        assert row[0].isdigit() and row[1].isdigit(), row
        assert all(unit.match(cell) for cell in row[2:]), row
    # A figure marked * at 1 device (where nothing crosses devices) says in the legend what it measures there.
    marked = [c for c in cells[0] if c.endswith("*")]
    assert not any(c.endswith("*") for row in cells[1:] for c in row)
    assert not marked or any(line.lstrip().startswith("*") and "1 device" in line for line in legend), legend


def test_bad_device_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--devices", "1,two"])
    assert "expected comma-separated ints such as 1,2,4, got '1,two'" in capsys.readouterr().err


def test_timeout_names_the_configuration():
    config = bench.BenchConfig(devices=(1,), timeout_s=0.01)
    with pytest.raises(RuntimeError, match=r"processes=1 devices=1 took more than 0.01 s"):
        bench._run_configuration(config, 1, 1)


def test_local_program_check_rejects_collectives():
    worker.check_no_collective("ROOT %add = f32[] add(%a, %b)")
    with pytest.raises(RuntimeError, match=r"must have no collective.*'all-reduce': 1"):
        worker.check_no_collective("%ar = f32[10] all-reduce(%g), replica_groups={{0,1}}")


@pytest.mark.parametrize("model", models.MODELS)
def test_torch_twins_compute_the_same_logits(model):
    torch = pytest.importorskip("torch", reason="PyTorch is only in the optional `bench` extra")
    import numpy as np

    from benchmarks.peers import torch_models

    params = models.init_params(model)
    x = models.synthetic_batches(1, 16)[0]["x"]
    expected = np.asarray(models.forward(model, params, x))
    with torch.no_grad():
        got = torch_models.build(model, params)(torch.from_numpy(x)).numpy()
    assert expected.shape == (16, models.CLASSES)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model", models.MODELS)
def test_reference_step_is_the_single_device_step(model):
    """The hand-written step the benchmarks compare against: on equal slices its pmean of means is the global mean."""
    mesh, optimizer = jddp.data_mesh(), optax.sgd(0.1)  # SGD: the update scales with the gradient, Adam's would not
    loss = functools.partial(models.mean_loss, model)
    params, batch = models.init_params(model), models.synthetic_batches(1, 8 * mesh.size)[0]
    rep = jddp.replicated(mesh)
    hand = jax.device_put(params, rep)
    got = models.reference_step(loss, optimizer, mesh)(
        hand, jax.jit(optimizer.init, out_shardings=rep)(hand), jax.device_put(batch, jddp.batch_sharding(mesh))
    )
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    np.testing.assert_allclose(got[2], value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(optax.apply_updates(params, updates)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
