"""``jddp bench``: a short real run whose figures must agree with each other, and its input errors."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import textwrap

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.benchmark import custom, models, worker
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
    # every other figure with its unit and its range at the timings' quartiles, ! where it is noise
    unit = re.compile(r"^\d[\d.]* ?(examples/s|x|%|ms|s)( \(\d[\d.]*-\d[\d.]*\))?!?\*?$")
    for row in cells:  # a count in the process and device columns (! where the whole row is noise)
        assert row[0].isdigit() and row[1].rstrip("!").isdigit(), row
        assert all(unit.match(cell) for cell in row[2:]), row
    # A figure marked * at 1 device (where nothing crosses devices) says in the legend what it measures there.
    marked = [c for c in cells[0] if c.endswith("*")]
    assert not any(c.endswith("*") for row in cells[1:] for c in row)
    assert not marked or any(line.lstrip().startswith("*") and "1 device" in line for line in legend), legend


def test_bad_device_list_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--devices", "1,two"])
    assert "expected comma-separated ints such as 1,2,4, got '1,two'" in capsys.readouterr().err


@pytest.mark.multiprocess  # starts a process of its own
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


# An Equinox model defined outside jddp, as a user's module: its batch function records the sizes it is asked for,
# so that the test sees each configuration run this model and not a built-in one.
EQX_MODULE = """
import os

import equinox as eqx
import jax
import numpy as np
import optax

import jddp
from jddp.benchmark import BenchModel


def bench():
    model = eqx.nn.MLP(in_size=16, out_size=4, width_size=48, depth=2, key=jax.random.key(0))
    static, params, model_state = jddp.models.eqx_split(model)

    def loss(model, batch, key):
        logits = jax.vmap(model)(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def batch(size):
        with open(os.path.join(os.path.dirname(__file__), "sizes.txt"), "a") as f:
            f.write(f"{size}\\n")
        rng = np.random.default_rng(0)
        return {"x": rng.normal(size=(size, 16)).astype(np.float32), "y": rng.integers(0, 4, size).astype(np.int32)}

    return BenchModel(jddp.models.eqx_loss(static, loss), params, batch, optimizer=optax.sgd(0.05),
                      model_state=model_state)
"""


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """``tmp_path`` as the current directory, the import path and module cache restored afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.startswith("user_"):
            del sys.modules[name]


@pytest.mark.slow
def test_bench_runs_a_users_equinox_model(user_dir):
    """``jddp bench --model MODULE:FUNCTION`` on an Equinox model in the current directory, as a user runs it:
    every configuration trains that model (its batch function asked for 32 x dev rows in each), and the gradient
    bytes reported are its parameters'."""
    import equinox as eqx

    (user_dir / "eqxmodel.py").write_text(EQX_MODULE)
    argv = ["bench", "--model", "eqxmodel:bench", "--devices", "1,2", "--batch-per-device", "32"]
    argv += ["--steps", "3", "--rounds", "1", "--warmup", "1", "--output", "out"]
    proc = subprocess.run([sys.executable, "-m", "jddp.cli.main", *argv], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((user_dir / "out.json").read_text())
    assert report["config"]["model"] == "eqxmodel:bench"
    assert [(r["devices"], r["global_batch"]) for r in report["rows"]] == [(1, 32), (2, 64)]
    # Sizes asked: 2 by the parent's check, then each configuration's global batch in its one process.
    assert sorted(int(n) for n in (user_dir / "sizes.txt").read_text().split()) == [2, 32, 64]
    mlp = eqx.nn.MLP(in_size=16, out_size=4, width_size=48, depth=2, key=jax.random.key(0))
    expected = sum(leaf.nbytes for leaf in jax.tree.leaves(eqx.filter(mlp, eqx.is_inexact_array)))
    assert all(raw["grad_bytes"] == expected == 4 * (16 * 48 + 48 + 48 * 48 + 48 + 48 * 4 + 4) for raw in report["raw"])
    assert "eqxmodel:bench, 1 process(es), 2 device(s)" in proc.stdout


def _write(directory, name: str, body: str) -> str:
    (directory / f"{name}.py").write_text(textwrap.dedent(body))
    return name


MINIMAL = """
    import numpy as np

    def loss_fn(params, model_state, batch, rng):
        return ((batch["x"] @ params["w"]) ** 2).mean(), (model_state, {})

    PARAMS = {"w": np.ones((3, 1), np.float32)}
    BATCH = {"x": np.ones((5, 3), np.float32)}
"""


@pytest.mark.parametrize(
    ("body", "spec", "error", "match"),
    [
        ("", "nosuchmodule:f", ValueError, r"no module 'nosuchmodule' on Python's import path .* Run jddp bench from"),
        ("def g(): pass", "{m}:f", TypeError, r"'f' in module '\w+' .* no attribute of that name.*\['g', 'loss_fn'\]"),
        ("f = 3", "{m}:f", TypeError, r"'f' in module .* is a int"),
        ("def f(): return 3", "{m}:f", TypeError, r"f\(\) returned a int\. FUNCTION\(\) must return"),
        ("def f(): return {'loss_fn': loss_fn, 'params': PARAMS}", "{m}:f", TypeError, r"missing \['batch'\]"),
        (
            "def f(): return {'loss_fn': loss_fn, 'params': PARAMS, 'batch': BATCH, 'lr': 1}",
            "{m}:f",
            TypeError,
            r"unknown \['lr'\]",
        ),
        (
            "def f(): return {'loss_fn': 1, 'params': PARAMS, 'batch': BATCH}",
            "{m}:f",
            TypeError,
            r"loss_fn is a int, not callable",
        ),
        (
            "def f(): return {'loss_fn': loss_fn, 'params': PARAMS, 'batch': [1]}",
            "{m}:f",
            TypeError,
            r"batch is a list",
        ),
        (
            "def f(): return {'loss_fn': loss_fn, 'params': PARAMS, 'batch': BATCH, 'optimizer': 0.1}",
            "{m}:f",
            TypeError,
            r"optimizer is a float, not an optax GradientTransformation",
        ),
        ("def f(): raise KeyError('boom')", "{m}:f", RuntimeError, r"calling \w+:f\(\) raised KeyError\('boom'\)"),
        ("raise ImportError('broken')", "{m}:f", RuntimeError, r"importing '\w+' .* raised ImportError"),
    ],
    ids=[
        "no-module",
        "no-function",
        "not-callable",
        "wrong-return",
        "missing-key",
        "unknown-key",
        "loss-not-callable",
        "batch-not-dict",
        "optimizer",
        "function-raises",
        "import-raises",
    ],
)
def test_a_users_model_that_does_not_fit_is_named_with_the_fix(user_dir, request, body, spec, error, match):
    name = _write(user_dir, f"user_{request.node.callspec.id.replace('-', '_')}", textwrap.dedent(MINIMAL) + body)
    with pytest.raises(error, match=match):
        custom.load(spec.format(m=name))


def test_a_users_batch_is_repeated_to_the_global_batch_or_must_have_its_rows(user_dir):
    body = (
        "def fixed(): return dict(loss_fn=loss_fn, params=PARAMS, batch={'x': np.arange(10.0).reshape(5, 2)})\n"
        "def short(): return dict(loss_fn=loss_fn, params=PARAMS, batch=lambda n: {'x': np.zeros((n - 1, 3))})\n"
    )
    name = _write(user_dir, "user_batches", textwrap.dedent(MINIMAL) + body)
    got = custom.global_batch(custom.load(f"{name}:fixed"), "m", 7)["x"]
    np.testing.assert_array_equal(got[:, 0], [0, 2, 4, 6, 8, 0, 2])
    with pytest.raises(ValueError, match=r"batch\(8\) gave batch\['x'\] of 7 rows; it must give 8"):
        custom.global_batch(custom.load(f"{name}:short"), f"{name}:short", 8)


@pytest.mark.multiprocess  # starts a process of its own
def test_bench_refuses_a_users_model_before_running_any_configuration(user_dir, capsys):
    """The parent checks the function in a child process; its error comes back as a usage error, with no
    configuration started (no JSON written)."""
    _write(user_dir, "user_nofn", "def other(): pass\n")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--model", "user_nofn:bench", "--devices", "1", "--output", "out"])
    assert exit_info.value.code == 2
    assert "'bench' in module 'user_nofn'" in capsys.readouterr().err
    with pytest.raises(TypeError, match=r"'bench' in module 'user_nofn'.*\['other'\]"):
        bench.check_model(bench.BenchConfig(model="user_nofn:bench"))
    assert not (user_dir / "out.json").exists()
    with pytest.raises(ValueError, match=r"`model` must be one of \('mlp', 'cnn'\) or MODULE:FUNCTION"):
        bench.BenchConfig(model="user_nofn.bench")


def test_the_benchmarks_guide_shows_the_example_that_ships():
    """docs/guides/benchmarks.md shows jddp/benchmark/example.py's code, which its command runs: the page and the
    file cannot drift apart."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (root / "jddp/benchmark/example.py").read_text().split("# ---\n")[1].strip()
    page = (root / "docs/guides/benchmarks.md").read_text()
    assert f"```python\n{code}\n```" in page
    assert "jddp bench --model jddp.benchmark.example:bench" in page
    assert isinstance(custom.load("jddp.benchmark.example:bench"), custom.BenchModel)
