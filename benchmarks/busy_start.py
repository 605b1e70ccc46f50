"""Started beside two busy processes under ``--max-restarts 1``, does a run ever spend its restart before step 1?

Busy start: ``--runs`` runs (default 10) of ``jddp launch -n 2 --max-restarts 1`` on the MNIST-1D example
(``examples/mnist1d/train.py``, ``configs/mnist1d_mlp.yaml``, ``--epochs``, small), each started while two busy
processes (``python -c "while True: pass"``) spin beside the group, as spares, standby processes and other jobs
load a machine at a run's start. Per run: whether a restart was spent before step 1 (the launcher says
"restarting the group" and the first attempt's goodput ledger has no step), the time from the launcher's start to
the end of the first step (the ledgers' ``first_step_end``), the restarts, the exit code and the load average.
Prints "restarts spent before step 1: k of N", the median and spread of the time to the first step, the load.

    python -m benchmarks busy_start [--runs 10] [--epochs 2] [--busy 2]

The busy processes make the machine busy on purpose: the harness's warning about a loaded machine is expected
(do not pass ``--require-quiet``). Measure with nothing else running beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "mnist1d" / "train.py"
CONFIG = ROOT / "configs" / "mnist1d_mlp.yaml"
RESTARTED = "restarting the group"  # jddp launch's line when it restarts the group after a failure
BUSY = "while True: pass"


def busy_processes(count: int) -> list[subprocess.Popen]:
    """``count`` processes that spin on a core each until stopped."""
    return [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(count)]


def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """One launch beside the busy processes: restarts, whether one came before step 1, time to the first step."""
    from jddp import goodput, goodput_ledger

    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)
        argv = [
            sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", "1",
            str(SCRIPT), f"config={CONFIG}", f"epochs={args.epochs}", "progress=false",
            f"log_dir={run_dir}/log", f"checkpoint_dir={run_dir}/ckpt",
        ]  # fmt: skip
        started = time.time()
        done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT, timeout=args.timeout)
        ledgers = sorted((Path(run_dir) / "log" / goodput.LEDGER_DIR).glob("*/attempt-*.ledger"))
        read = [goodput_ledger.read(p) for p in ledgers]
    restarts = done.stderr.count(RESTARTED)
    first_attempt = next((r for r in read if int(r["attempt"]) == 0), None)
    stepped = [r for r in read if r["steps_run"] > 0]
    return {
        "exit": done.returncode,
        "restarts": restarts,
        # the restart was spent before step 1: attempt 0 failed without a step (no ledger, or one with no step)
        "restart_before_step_1": restarts > 0 and (first_attempt is None or first_attempt["steps_run"] == 0),
        "first_step_s": (stepped[0]["first_step_end"] - started) if stepped else None,
        "load": os.getloadavg()[0],
        "tail": done.stderr[-1500:] if done.returncode else "",
    }


QUICK: dict[str, Any] = {"runs": 2, "epochs": 1}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="launches, one after another (default 10)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs of each run (default 2)")
    parser.add_argument("--busy", type=int, default=2, help="busy processes beside the group (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one launch may take (default 900)")
    return parser


def bench(args: argparse.Namespace) -> dict[str, Any]:
    print(f"busy_start: {args.runs} runs beside {args.busy} busy processes, load {os.getloadavg()[0]:.2f}", flush=True)
    spinning = busy_processes(args.busy)
    runs = []
    try:
        for i in range(args.runs):
            r = one_run(args)
            runs.append(r)
            first = "no step" if r["first_step_s"] is None else f"{r['first_step_s']:.1f} s"
            print(
                f"  run {i}: exit {r['exit']}, {r['restarts']} restart(s), restart before step 1: "
                f"{r['restart_before_step_1']}, launch to first step {first}, load {r['load']:.2f}",
                flush=True,
            )
            if r["tail"]:
                print("    " + r["tail"].replace("\n", "\n    "), flush=True)
    finally:
        for p in spinning:
            p.kill()
            p.wait()
    spent = sum(r["restart_before_step_1"] for r in runs)
    firsts = [r["first_step_s"] for r in runs if r["first_step_s"] is not None]
    print(f"restarts spent before step 1: {spent} of {len(runs)}", flush=True)
    if firsts:
        print(
            f"launch to first step: median {statistics.median(firsts):.1f} s, min {min(firsts):.1f}, max "
            f"{max(firsts):.1f} ({len(firsts)} runs); load average at the end {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return {
        "restarts_spent_before_step_1": spent,
        "runs": len(runs),
        "first_step_s": firsts,
        "median_first_step_s": statistics.median(firsts) if firsts else None,
        "per_run": [{k: v for k, v in r.items() if k != "tail"} for r in runs],
    }


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
