"""Does a lower priority for preparing standby processes spare the running attempt, and at what readiness cost?

    python -m benchmarks standby_priority [--rounds 3] [--nice 0,10,19] [--busy 0] [--epochs 30]

Runs the MNIST-1D MLP (``examples/mnist1d/train.py``) under ``jddp launch -n 2 --max-restarts 3 --standby-depth 2
--standby-nice N``, never killed, for each N of ``--nice`` in turn, round after round (the arms interleaved). Per run,
from the launcher's start: when the first generation of standby processes stood by (the launcher's "standby
process(es) of the next attempt ready" line) and the second ("ready further ahead"); and the running attempt's
pace while they prepare: the seconds its processes took for the steps between the moment the spares started
(attempt 0's first step, or ``PREPARE_AFTER_S``) and the second generation's readiness, per step, against its
pace after (the goodput ledger sampled every 50 ms). Prints medians and ranges per arm and the load average.
``--busy N`` runs N busy processes beside the group (two busy processes: the issue's loaded case).

The autogroup nice value is the only priority that an unprivileged launcher can lower and raise again
(``jddp.cli.launch.spares``); where autogroups are off it changes nothing, and so neither do the arms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness, procs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "mnist1d" / "train.py"
CONFIG = ROOT / "configs" / "mnist1d_mlp.yaml"
FIRST = "standby process(es) of the next attempt ready"  # jddp.cli.launch.spares.STANDBY_READY
SECOND = "standby process(es) ready further ahead"  # jddp.cli.launch.spares.LATER_READY


def one_run(nice: int, args: argparse.Namespace) -> dict | None:
    from jddp import goodput

    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)
        argv = [
            sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", "3", "--standby-depth", "2",
            "--standby-nice", str(nice), str(SCRIPT), f"config={CONFIG}", f"epochs={args.epochs}", "progress=false",
            f"log_dir={run_dir}/log", f"checkpoint_dir={run_dir}/ckpt",
        ]  # fmt: skip
        start = time.time()
        launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        ready: dict[str, float] = {}

        def read() -> None:
            assert launcher.stderr is not None
            for raw in launcher.stderr:
                line = raw.decode(errors="replace")
                for name, text in (("first", FIRST), ("second", SECOND)):
                    if text in line and name not in ready:
                        ready[name] = time.time() - start

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        steps: list[tuple[float, float]] = []  # (seconds from the start, steps run) of attempt 0
        ledgers = Path(run_dir) / "log" / goodput.LEDGER_DIR
        while launcher.poll() is None:
            found = sorted(ledgers.glob("*/attempt-*.ledger"))
            if found:
                try:
                    steps.append((time.time() - start, goodput.read(found[0])["steps_run"]))
                except (OSError, ValueError):
                    pass
            time.sleep(0.05)
        reader.join(10)
        if launcher.returncode != 0 or "second" not in ready:
            print(f"  nice {nice}: exit {launcher.returncode}, ready {ready}", flush=True)
            return None
        ledger = goodput.read(sorted(ledgers.glob("*/attempt-*.ledger"))[0])
        first_step = ledger["first_step_end"] - start

        def pace(t0: float, t1: float) -> float | None:
            inside = [(t, s) for t, s in steps if t0 <= t <= t1]
            if len(inside) < 2 or inside[-1][1] == inside[0][1]:
                return None
            return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])

        return {
            "first_step_s": first_step,
            "first_ready_s": ready["first"],
            "second_ready_s": ready["second"],
            "step_s_while_preparing": pace(first_step, ready["second"]),
            "step_s_after": pace(ready["second"], steps[-1][0]),
        }


QUICK: dict[str, Any] = {"rounds": 1, "nice": "0,19", "epochs": 20}


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nice", default="0,10,19", help="comma-separated --standby-nice values (default 0,10,19)")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the group (default 0)")
    parser.add_argument("--epochs", type=int, default=30, help="long enough for both generations to stand by")
    return parser


def bench(args: argparse.Namespace) -> Any:
    arms = [int(n) for n in args.nice.split(",")]
    print(f"standby_priority: arms nice {arms}, {args.rounds} rounds, {args.busy} busy, load {os.getloadavg()[0]:.2f}")
    results: dict[int, list[dict]] = {n: [] for n in arms}
    with procs.busy_processes(args.busy):
        for i in range(args.rounds):
            for nice in arms if i % 2 == 0 else arms[::-1]:
                r = one_run(nice, args)
                if r is not None:
                    results[nice].append(r)
                    said = ", ".join(f"{k} {v:.3f}" for k, v in r.items() if v)
                    print(f"  round {i} nice {nice}: {said}", flush=True)
    summary = {}
    for nice, runs in results.items():
        summary[nice] = {}
        for key in ("first_step_s", "first_ready_s", "second_ready_s", "step_s_while_preparing", "step_s_after"):
            values = [r[key] for r in runs if r[key] is not None]
            if values:
                summary[nice][key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
        print(f"nice {nice}: " + "; ".join(
            f"{k} median {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]" for k, v in summary[nice].items()
        ), flush=True)  # fmt: skip
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    return {"arms": {str(n): results[n] for n in arms}, "summary": {str(n): s for n, s in summary.items()}}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
