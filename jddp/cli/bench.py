"""``jddp bench``: throughput, speedup, scaling efficiency, latency and overhead of a training step.

Usage::

    jddp bench --model mlp --devices 1,2,4,8 --processes 1,2 --output runs/bench

Every configuration (``P`` processes holding ``D`` devices in all, ``D / P``
simulated CPU devices each) runs in fresh processes started through
``jddp launch``, because the device count is fixed when the JAX backend
starts. Configurations where ``P`` does not divide ``D`` are left out; 1
process with 1 device always runs (the baseline). ``--repeats R`` runs each
configuration ``R`` times, in alternating order, and pools the timings, so
that a slow phase of a shared machine hits every configuration.

Each configuration trains a model shaped for MNIST-1D (40 features, 10
classes; synthetic data) with AdamW, or the user's own model
(``--model MODULE:FUNCTION``, ``jddp.benchmark.custom``: its loss, parameters,
batches and optimizer), on ``--batch-per-device`` examples per
device (weak scaling, as DDP is used) and times three programs on the same
pre-placed global batches, interleaved round by round in alternating order
after ``--warmup`` steps:

* ``jddp``: ``DataParallel.step`` with its defaults;
* ``hand``: a hand-written ``jit(shard_map)`` step with one ``pmean``
  (``jddp.benchmark.models.reference_step``);
* ``local``: the same step without the ``pmean`` (no collective at all;
  checked in the compiled HLO): computation and update only.

Reported per configuration: throughput (examples/s, from the median time per
step of pipelined runs of ``--steps`` steps); speedup and scaling efficiency
(speedup / devices) against 1 process with 1 device; step latency (each step
waited for: median and p90); the overhead, (``jddp`` - ``local``) /
``jddp``: the part of jddp's step that the same computation without a
collective does not take (the gradient all-reduce and what jddp adds around
it; at 1 device, where the all-reduce has a group of one and sends nothing,
only the latter; ``allreduce_share`` in the JSON); jddp's step time over
``hand``'s; and compile time (the first ``DataParallel.step`` call, which
includes one step). Output: a table on stdout with its legend under it (every
column, and the marked figure of the 1-device row), ``<output>.json`` and
``<output>.png``. Every figure comes with its range at the quartiles of the
timed runs, the run with the machine's load (the load average, and the CPU
other processes used while each configuration ran), and a figure that only
the machine's noise can explain (an efficiency over 100%, an overhead that
contradicts the ``jddp/hand`` ratio, a wide spread, a busy machine) is marked
``!`` with a ``noise:`` line giving the reason (``jddp.benchmark.noise``).

The models live in ``jddp.benchmark.models``; each process of a configuration
runs ``python -m jddp.benchmark.worker``. This module is the command line and
the parent process, which imports no JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable

from jddp import envvars, validate
from jddp.benchmark import custom, models, noise


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What ``jddp bench`` runs."""

    model: str = "mlp"  # "mlp" (40-256-256-10), "cnn" (3 conv1d layers of 32 channels, then dense) or MODULE:FUNCTION
    devices: tuple[int, ...] = (1, 2, 4, 8)  # total device counts; must include 1 (the baseline)
    processes: tuple[int, ...] = (1,)  # process counts; each runs the device counts it divides
    batch_per_device: int = 64  # examples per device and step
    steps: int = 20  # steps per timed run
    warmup: int = 5  # untimed steps of each program first
    rounds: int = 5  # interleaved timed runs of each program
    repeats: int = 1  # fresh runs of every configuration, in alternating order; timings pooled
    output: str = "bench"  # writes <output>.json and <output>.png
    timeout_s: float = 600.0  # per configuration

    def __post_init__(self):
        validate.check_str("model", self.model)
        if self.model not in models.MODELS and not custom.is_spec(self.model):
            raise ValueError(
                f"`model` must be one of {models.MODELS} or MODULE:FUNCTION (your own model, such as "
                f"mymodel:bench; see jddp bench --help), got model={self.model!r}."
            )
        for name in ("devices", "processes"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"`{name}` must be a non-empty list of ints >= 1, got {name}={values!r}.")
            for v in values:
                validate.check_int(name, v, fix=f"Give a list such as --{name} 1,2.")
        if 1 not in self.devices:
            raise ValueError(f"`devices` must include 1, the baseline of speedup, got devices={self.devices!r}.")
        for name in ("batch_per_device", "steps", "rounds", "repeats"):
            validate.check_int(name, getattr(self, name))
        validate.check_int("warmup", self.warmup, minimum=0)
        if not any(d % p == 0 for p in self.processes for d in self.devices):
            raise ValueError(
                f"No process count in processes={self.processes!r} divides a device count in "
                f"devices={self.devices!r}; each process needs a whole number of devices."
            )

    def configurations(self) -> list[tuple[int, int]]:
        """The ``(processes, devices)`` pairs to run, always with the baseline ``(1, 1)`` first."""
        return sorted({(1, 1)} | {(p, d) for p in self.processes for d in self.devices if d % p == 0})


def get_args_parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(
        prog="jddp bench",
        description="Throughput, scaling and latency of a jddp step, on a built-in model or your own.",
        epilog=custom.HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=d.model,
        metavar="{mlp,cnn,MODULE:FUNCTION}",
        help="a built-in model (mlp: 40-256-256-10; cnn: three conv1d layers, then dense) or your own, "
        "MODULE:FUNCTION (below) (default mlp)",
    )
    p.add_argument("--devices", type=envvars.counts(1), default=d.devices, help="total device counts (default 1,2,4,8)")
    p.add_argument("--processes", type=envvars.counts(1), default=d.processes, help="process counts (default 1)")
    p.add_argument(
        "--batch-per-device", type=envvars.count(1), default=d.batch_per_device, help="examples per device (default 64)"
    )
    p.add_argument("--steps", type=envvars.count(1), default=d.steps, help="steps per timed run (default 20)")
    p.add_argument("--warmup", type=envvars.count(0), default=d.warmup, help="untimed steps first (default 5)")
    p.add_argument("--rounds", type=envvars.count(1), default=d.rounds, help="interleaved timed runs (default 5)")
    p.add_argument(
        "--repeats",
        type=envvars.count(1),
        default=d.repeats,
        help="runs of each configuration, alternating (default 1)",
    )
    p.add_argument("--output", default=d.output, help="path prefix of the JSON and PNG (default ./bench)")
    p.add_argument(
        "--timeout", type=envvars.seconds(), default=d.timeout_s, help="seconds per configuration (default 600)"
    )
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    fields = {f.name for f in dataclasses.fields(BenchConfig)} - {"timeout_s"}
    return BenchConfig(**{k: getattr(args, k) for k in fields}, timeout_s=args.timeout)


# ----------------------------------------------------------------- parent


def _run_configuration(config: BenchConfig, processes: int, devices: int) -> dict:
    """Runs one configuration in fresh processes under ``jddp launch``; returns process 0's figures."""
    with tempfile.TemporaryDirectory(prefix="jddp-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        worker = ["-m", "jddp.benchmark.worker", "--model", config.model, "--out", out]
        worker += [f"--{k}={getattr(config, k)}" for k in ("batch_per_device", "steps", "warmup", "rounds")]
        cmd = [sys.executable, "-m", "jddp.launch", "-n", str(processes), "--term-timeout", "5"]
        cmd += ["--peer-timeout", "120"]  # a loaded machine can stall a process for a while (compiles)
        cmd += ["--devices-per-process", str(devices // processes), *worker]
        env = {k: v for k, v in os.environ.items() if not k.startswith("JDDP_") and k != "XLA_FLAGS"}
        others = noise.OtherLoad().start()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=config.timeout_s)
        except subprocess.TimeoutExpired as e:
            proc.terminate()  # the launcher forwards SIGTERM to its workers and kills them 5 s later
            proc.communicate(timeout=60)
            raise RuntimeError(
                f"Configuration processes={processes} devices={devices} took more than {config.timeout_s:g} s; "
                "raise --timeout or lower --steps/--rounds."
            ) from e
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(
                f"Configuration processes={processes} devices={devices} failed (exit {proc.returncode}):\n"
                f"{stdout}\n{stderr}"
            )
        with open(out) as f:
            return {**json.load(f), "others_cores": others.stop()}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _base(rows: list[dict]) -> dict:
    return next(row for row in rows if row["processes"] == 1 and row["devices"] == 1)


def summarize(raw: list[dict]) -> list[dict]:
    """Derived figures per configuration from the workers' raw timings (milliseconds).

    ``allreduce_ms`` is jddp's step minus the same computation without a
    collective (``local_ms``); ``hand_ms`` is the hand-written step with ``pmean``.
    Each row also holds its figures' ``ranges`` at the timings' quartiles, the
    other processes' load while it ran (``others_cores``) and its ``noise``
    flags, ``{figure: reason}`` (``jddp.benchmark.noise``).
    """
    rows = []
    for r in raw:
        step, hand, local = (statistics.median(r[k]) for k in ("jddp_ms", "hand_ms", "local_ms"))
        allreduce = max(0.0, step - local)
        rows.append({
            "processes": r["processes"],
            "devices": r["devices"],
            "global_batch": r["global_batch"],
            "step_ms": step,
            "throughput": r["global_batch"] / step * 1e3,
            "latency_median_ms": statistics.median(r["latency_ms"]),
            "latency_p90_ms": _percentile(r["latency_ms"], 0.9),
            "hand_ms": hand,
            "local_ms": local,
            "allreduce_ms": allreduce,
            "allreduce_share": allreduce / step,
            "overhead_vs_hand": step / hand,
            "compile_s": r["compile_s"],
            "grad_bytes": r["grad_bytes"],
        })  # fmt: skip
    base = _base(rows)
    for row, r in zip(rows, raw, strict=True):
        row["speedup"] = row["throughput"] / base["throughput"]
        row["efficiency"] = row["speedup"] / row["devices"]
        row["ranges"] = noise.figure_ranges(r, _base(raw))
        row["others_cores"] = r.get("others_cores")
        row["noise"] = noise.flags(row, others_cores=row["others_cores"])
    return rows


def _is_baseline(row: dict) -> bool:
    return row["processes"] == 1 and row["devices"] == 1


def _figure(row: dict, key: str, unit: str, digits: str, scale: float = 1.0) -> str:
    """A figure's cell: its value from the medians, its range at the timings' quartiles in parentheses, and ``!``
    when ``jddp.benchmark.noise`` flagged it."""
    value = f"{scale * row[key]:{digits}}{unit}"
    if key in row.get("ranges", {}):
        lo, hi = row["ranges"][key]
        value += f" ({scale * lo:{digits}}-{scale * hi:{digits}})"
    return value + ("!" if key in row.get("noise", {}) else "")


# The table's columns: (name, what it is, the cell of a row). The legend printed under the table is the second field.
COLUMNS: tuple[tuple[str, str, Callable[[dict], str]], ...] = (
    ("proc", "processes", lambda r: f"{r['processes']}"),
    (
        "dev",
        "devices in all (dev / proc simulated CPU devices in each process)",
        lambda r: f"{r['devices']}" + ("!" if "row" in r.get("noise", {}) else ""),
    ),
    (
        "throughput",
        "examples per second, the global batch (--batch-per-device x dev) over the median time per step of "
        "pipelined runs of --steps steps",
        lambda r: _figure(r, "throughput", " examples/s", ".0f") + ("!" if "step_ms" in r.get("noise", {}) else ""),
    ),
    ("speedup", "throughput over the 1-process, 1-device row's", lambda r: _figure(r, "speedup", "x", ".2f")),
    (
        "efficiency",
        "speedup / dev (100% is linear scaling; more is noise: the devices share the same cores)",
        lambda r: _figure(r, "efficiency", "%", ".0f", 100.0),
    ),
    (
        "step p50",
        "latency of a step waited for on its own: the median (its quartiles)",
        lambda r: _figure(r, "latency_median_ms", " ms", ".2f"),
    ),
    ("step p90", "the same, 90th percentile", lambda r: f"{r['latency_p90_ms']:.2f} ms"),
    (
        "overhead",
        "(jddp step - bare step) / jddp step, the bare step being the same computation and update with no "
        "collective: the gradient all-reduce and jddp's own work around it (counts, masks, the non-finite guard)",
        lambda r: _figure(r, "allreduce_share", "%", ".0f", 100.0) + ("*" if _is_baseline(r) else " "),
    ),
    (
        "jddp/hand",
        "jddp's step time over a hand-written jit(shard_map) step with one pmean",
        lambda r: _figure(r, "overhead_vs_hand", "x", ".3f"),
    ),
    (
        "compile",
        "the first DataParallel.step call (one step included; the median over --repeats, their min-max)",
        lambda r: _figure(r, "compile_s", " s", ".2f"),
    ),
)
SPREAD_NOTE = (
    "(a-b): the figure at the quartiles of the timed runs (--rounds x --repeats per program), lower to upper; "
    "!: a figure that cannot be true of the step, only of the machine, with its noise: line below"
)
BASELINE_NOTE = (
    "* at 1 device nothing crosses devices (the step's all-reduce has a group of one and sends 0 bytes): the "
    "overhead there is jddp's own work only"
)


def noise_lines(rows: list[dict], load: dict | None = None) -> list[str]:
    """One ``noise:`` line per flagged figure of ``rows`` (``jddp.benchmark.noise.flags``) and for a busy ``load``."""
    lines = [f"noise: {reason}" for row in rows for reason in row.get("noise", {}).values()]
    note = noise.busy_note(load) if load is not None else None
    return lines + ([f"noise: {note}"] if note else [])


def format_table(rows: list[dict], load: dict | None = None) -> str:
    """The table, then its legend (what each column is, the marked figures of the 1-device row), then a ``noise:``
    line for each figure flagged as noise and the machine's load (``load``: ``noise.LoadSampler.stop``'s)."""
    cells = [[cell(r) for _, _, cell in COLUMNS] for r in rows]
    widths = [max(len(name), *(len(row[i]) for row in cells)) for i, (name, _, _) in enumerate(COLUMNS)]
    lines = ["  ".join(name.rjust(w) for (name, _, _), w in zip(COLUMNS, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.append("")
    notes = [f"{name}: {legend}" for name, legend, _ in COLUMNS]
    if any(c.endswith("*") for row in cells for c in row):
        notes.append(BASELINE_NOTE)
    notes.append(SPREAD_NOTE)
    lines += [textwrap.fill(note, 116, initial_indent="  ", subsequent_indent="      ") for note in notes]
    if load is not None:
        measured = [r for r in rows if r.get("others_cores") is not None]
        others = [f"{r['processes']}x{r['devices']} {r['others_cores']:.2f}" for r in measured]
        line = (
            f"load: 1-minute load average {load['start'][0]:.2f} at the start, {load['max']:.2f} at most, "
            f"{load['end'][0]:.2f} at the end, on {load['cores']} cores"
            + (f"; other processes' CPU (proc x dev: cores): {', '.join(others)}" if others else "")
        )
        lines.append(textwrap.fill(line, 116, subsequent_indent="    "))
    lines += [textwrap.fill(line, 116, subsequent_indent="    ") for line in noise_lines(rows, load)]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Writes a PNG: throughput, efficiency, latency and overhead against devices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for p in sorted({r["processes"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["processes"] == p]
        dev = [r["devices"] for r in rows]
        label = f"{p} process{'es' if p > 1 else ''}"
        axes[0].plot(dev, [r["throughput"] for r in rows], "o-", label=label)
        axes[1].plot(dev, [r["efficiency"] for r in rows], "o-", label=label)
        (line,) = axes[2].plot(dev, [r["latency_median_ms"] for r in rows], "o-", label=f"{label} p50")
        axes[2].plot(dev, [r["latency_p90_ms"] for r in rows], "x--", color=line.get_color(), label=f"{label} p90")
        axes[3].plot(dev, [100 * r["allreduce_share"] for r in rows], "o-", label=label)
    titles = ("throughput (examples/s)", "scaling efficiency", "step latency (ms)", "overhead over the bare step (%)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("devices")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["devices"] for r in report["rows"]}), labels=None)
    for ax in (axes[0], axes[2]):
        ax.set_yscale("log")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"jddp bench: {report['config']['model']}, {report['config']['batch_per_device']} examples/device")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90)
    plt.close(fig)


def _merge(results: list[dict]) -> dict:
    """One configuration's repeats as one: timings pooled, compile times by their median."""
    merged = dict(results[0])
    for key in ("jddp_ms", "hand_ms", "local_ms", "latency_ms"):
        merged[key] = [v for r in results for v in r[key]]
    for key in ("compile_s", "hand_compile_s"):
        merged[key] = statistics.median(r[key] for r in results)
    merged["compile_s_runs"] = [r["compile_s"] for r in results]
    others = [r["others_cores"] for r in results if r.get("others_cores") is not None]
    merged["others_cores"] = max(others) if others else None  # the busiest repeat's
    return merged


_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "RuntimeError": RuntimeError}


def check_model(config: BenchConfig) -> None:
    """For ``--model MODULE:FUNCTION``: the module on the import path, then, in a child process (this one imports
    no JAX), the function called and what it returns checked. Raises the child's ``ValueError``, ``TypeError``
    or ``RuntimeError``, naming the value and the fix, before any configuration runs."""
    if not custom.is_spec(config.model):
        return
    custom.find(config.model)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JDDP_") and k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "jddp.benchmark.custom", config.model]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=config.timeout_s)
    if proc.returncode != 0:
        name, _, message = proc.stderr.strip().rpartition("\n")[2].partition(": ")
        if name not in _ERRORS:
            raise RuntimeError(f"Checking model={config.model!r} failed (exit {proc.returncode}):\n{proc.stderr}")
        raise _ERRORS[name](message)


def run(config: BenchConfig, *, check: bool = True) -> dict:
    """Runs every configuration, prints the table, writes ``<output>.json`` and ``<output>.png``.

    ``check=False`` skips ``check_model`` (``main`` has run it, to report its errors as usage errors).
    """
    if check:
        check_model(config)
    configs = config.configurations()
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    sampler = noise.LoadSampler().start()
    for repeat in range(config.repeats):  # configurations alternate, so slow phases of the machine hit all alike
        for processes, devices in configs if repeat % 2 == 0 else configs[::-1]:
            print(f"jddp bench: {config.model}, {processes} process(es), {devices} device(s), repeat {repeat + 1} "
                  f"of {config.repeats} ...", flush=True)  # fmt: skip
            runs[processes, devices].append(_run_configuration(config, processes, devices))
    load = sampler.stop()
    raw = [_merge(runs[c]) for c in configs]
    report = {"config": dataclasses.asdict(config), "raw": raw, "rows": summarize(raw), "load": load}
    report["busy"] = noise.busy_note(load) is not None
    print(format_table(report["rows"], load))
    os.makedirs(os.path.dirname(os.path.abspath(config.output)), exist_ok=True)
    with open(f"{config.output}.json", "w") as f:
        json.dump(report, f, indent=1)
    plot(report, f"{config.output}.png")
    print(f"wrote {config.output}.json and {config.output}.png")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = get_args_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        check_model(config)
    except (ValueError, TypeError, RuntimeError) as e:
        parser.error(str(e))
    run(config, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
