"""The one command of jddp's benchmarks: list them, run one, or regenerate every figure BENCHMARKS.md quotes.

    python -m benchmarks --list                      # every benchmark and the question it answers
    python -m benchmarks NAME [its arguments]        # one benchmark (NAME --help: its arguments)
    python -m benchmarks all [--quick] [--out DIR]   # every figure BENCHMARKS.md quotes, each record in DIR

A benchmark is a module of ``benchmarks/`` (or a package's ``run.py``, as ``benchmarks/peers``) that defines
``main(argv)``; its docstring's first line is its question. The registry reads the files (no imports), so
``--list`` is instant. ``all`` runs each quoted benchmark in a fresh process with the arguments its figures were
measured with (``ALL``; with ``--quick``, the benchmark's own tiny size instead), writes each record to
``DIR/<label>.json`` and prints where each figure went; a benchmark whose extra is missing (PyTorch, mpi4jax) is
skipped with the reason.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
NOT_BENCHMARKS = {"__main__", "__init__"}

# Every run BENCHMARKS.md quotes: (label, benchmark, its arguments as quoted, the extra it needs). ``jddp`` is the
# CLI's own ``jddp bench``. With ``--quick`` the arguments are dropped for the benchmark's ``--quick`` size.
ALL: list[tuple[str, str, list[str], str | None]] = [
    ("bench_mlp", "jddp", ["bench", "--model", "mlp", "--devices", "1,2,4,8", "--processes", "1,2", "--repeats", "2"],
     None),
    ("bench_cnn", "jddp", ["bench", "--model", "cnn", "--devices", "1,2,4,8", "--processes", "1,2", "--repeats", "2"],
     None),
    ("peers", "peers", ["--processes", "1,2", "--models", "mlp,cnn"], "torch"),
    ("allreduce", "allreduce", [], "torch"),
    ("step_overhead", "step_overhead", ["--devices", "8"], None),
    ("first_step", "first_step", [], "torch"),
    ("peers_mpi", "peers", ["--processes", "2", "--models", "mlp,mlp784", "--transport", "mpi", "--rounds", "9",
                            "--steps", "20"], "mpi4jax"),
    ("allreduce_mpi", "allreduce", ["--transport", "mpi", "--malloc", "tuned"], "mpi4jax"),
    ("step_parts", "step_parts", ["--rounds", "5", "--steps", "10"], "mpi4jax"),
    ("replica_check_256", "replica_check", ["--devices", "8", "--hidden", "256", "--rounds", "15"], None),
    ("replica_check_1024", "replica_check", ["--devices", "8", "--hidden", "1024", "--rounds", "15"], None),
    ("stall_detector", "stall_detector", ["--repeats", "3", "--peer-timeouts", "10,30,60", "--hogs", "0,2"], None),
    ("failure_bound", "failure_bound", ["--repeats", "2", "--peer-timeouts", "10,30,60", "--hogs", "0,2"], None),
    ("restart", "restart", ["--repeats", "10", "--no-fresh"], None),
    ("multiprocess_step", "multiprocess_step", ["--topologies", "1x8,2x1,2x2"], None),
    ("process_count", "process_count", ["--counts", "2,4,8,16,32", "--steps", "30"], None),
    ("zero", "zero", [], None),
    ("mixed_precision", "mixed_precision", ["--repeats", "3", "--cnn-epochs", "5", "--lm-steps", "100", "--float16"],
     None),
    ("snapshot_cost", "snapshot_cost", ["--repeats", "5", "--models", "mlp,lm"], None),
    ("snapshot_cost_within", "snapshot_cost", ["--within", "--repeats", "3", "--blocks", "20", "--block", "200"],
     None),
    ("snapshot_profile", "snapshot_profile", [], None),
    ("chaos", "chaos", ["--runs", "4", "--kills", "5", "--epochs", "10"], None),
    ("soak", "soak", [], None),
    ("save_leak", "save_leak", [], None),
    ("control_plane", "control_plane", [], None),
    ("control_plane_real", "control_plane_real", ["--n", "2,4,8,16,32", "--reps", "20"], None),
    ("elastic", "elastic", ["--repeats", "4"], None),
    ("readme_command", "readme_command", [], None),
    ("loader_throughput", "loader_throughput", [], None),
    ("bucketing", "bucketing", [], None),
    ("checkpoint_stall", "checkpoint_stall", [], None),
    ("busy_start", "busy_start", ["--runs", "10"], None),
    ("standby_compile", "standby_compile", ["--repeats", "10"], None),
    ("standby_priority", "standby_priority", ["--rounds", "3", "--nice", "0,10,19"], None),
    ("two_launcher_bound", "two_launcher_bound", [], None),
]  # fmt: skip
# Benchmarks with a results file of their own besides the record (its flag): ``all`` points it into DIR.
OWN_FILE = {"elastic": "--out", "readme_command": "--out", "soak": "--out"}


def source_of(name: str) -> Path | None:
    """The file that defines benchmark ``name``: ``benchmarks/<name>.py`` or ``benchmarks/<name>/run.py``."""
    for path in (HERE / f"{name}.py", HERE / name / "run.py"):
        if path.is_file():
            return path
    return None


def module_of(name: str) -> str:
    """The importable module of benchmark ``name``."""
    path = source_of(name)
    assert path is not None, name
    return "benchmarks." + ".".join(path.relative_to(HERE).with_suffix("").parts)


def registry() -> dict[str, str]:
    """Every benchmark, name -> question, read from the files: modules (and packages' ``run.py``) defining
    ``main``."""
    found = {}
    for path in sorted([*HERE.glob("*.py"), *HERE.glob("*/run.py")]):
        name = path.parent.name if path.name == "run.py" else path.stem
        if name in NOT_BENCHMARKS:
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            found[name] = (ast.get_docstring(tree) or "").strip().splitlines()[0]
    return found


def run_one(name: str, argv: Sequence[str]) -> int:
    """Runs benchmark ``name`` in this process with ``argv``."""
    module = importlib.import_module(module_of(name))
    module.main(list(argv))
    return 0


def missing(extra: str | None) -> bool:
    return extra is not None and importlib.util.find_spec(extra) is None


def command(name: str, args: list[str], quick: bool, out: Path, label: str) -> list[str]:
    """The command ``all`` runs for one entry of ``ALL``."""
    if name == "jddp":  # jddp bench: its own output files, no record
        small = ["--steps", "5", "--rounds", "2", "--warmup", "1", "--repeats", "1"] if quick else []
        return [str(Path(sys.executable).with_name("jddp")), *args, *small, "--output", str(out / label)]
    argv = [
        sys.executable,
        "-m",
        "benchmarks",
        name,
        *(["--quick"] if quick else args),
        "--json",
        str(out / f"{label}.json"),
    ]
    if name in OWN_FILE:
        argv += [OWN_FILE[name], str(out / f"{label}.data.json")]
    return argv


def run_all(quick: bool, out: Path) -> int:
    """Runs every entry of ``ALL`` in turn, each in a fresh process, and prints where each record went."""
    out.mkdir(parents=True, exist_ok=True)
    where, failed = [], []
    for label, name, args, extra in ALL:
        if missing(extra):
            print(f"== {label}: skipped, {extra} is missing (pip install -e '.[bench]' or '.[mpi]')", flush=True)
            where.append((label, f"skipped: no {extra}"))
            continue
        argv = command(name, args, quick, out, label)
        print(f"== {label}: {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        with open(out / f"{label}.txt", "w") as log:
            done = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=HERE.parent)
        seconds = time.perf_counter() - start
        print(f"   exit {done.returncode} in {seconds:.0f} s; output in {out / label}.txt", flush=True)
        if done.returncode != 0:
            failed.append(label)
        where.append((label, str(out / (label if name == "jddp" else f"{label}.json"))))
    print("\nwhere each figure went:")
    for label, path in where:
        print(f"  {label:<22} {path}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(__doc__ or "").splitlines()[0],
        usage="python -m benchmarks [--list] | NAME [args] | all [--quick] [--out DIR]",
    )
    parser.add_argument("--list", action="store_true", help="every benchmark and its question")
    parser.add_argument("name", nargs="?", help="a benchmark (see --list) or 'all'")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    known = registry()
    if not argv or argv[0] in ("--list", "-l"):
        width = max(map(len, known))
        for name, asks in known.items():
            print(f"{name:<{width}}  {asks}")
        return 0
    if argv[0] in ("-h", "--help"):
        get_args_parser().print_help()
        return 0
    if argv[0] == "all":
        parser = argparse.ArgumentParser(
            prog="python -m benchmarks all", description="every figure BENCHMARKS.md quotes"
        )
        parser.add_argument("--quick", action="store_true", help="each benchmark at its tiny size: a smoke run")
        parser.add_argument("--out", default="runs/benchmarks", help="the folder of the records and outputs")
        args = parser.parse_args(argv[1:])
        return run_all(args.quick, Path(args.out))
    if argv[0] not in known:
        get_args_parser().error(f"no benchmark {argv[0]!r}; the benchmarks are: {', '.join(known)}")
    return run_one(argv[0], argv[1:])


if __name__ == "__main__":
    sys.exit(main())
