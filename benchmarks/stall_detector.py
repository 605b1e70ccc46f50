"""How fast is a stall named, and is a slow run under load ever named one?

The stall detector: how fast a stall is named, and whether a slow run under load ever is.

    python -m benchmarks stall_detector [--floor 3] [--repeats 3] [--steps 500] [--spinners 4]
                                        [--peer-timeouts 10,30,60] [--hogs 0,2]

Detection: ``tests/workers/stall.py`` under ``jddp launch -n 2``; process 1 stalls at step 20 in its data loading
(``STALL=data``, under ``fit``) or in a Python loop of its own (``STALL=spin``, a hand-written loop). Printed: the
learned bound, the quiet time the watchdog judged, and the time from the stall to the group's end (the process's
own ``STALLING`` time stamp to the launcher's exit), medians and maxima over the repeats, at each peer timeout,
quiet and with ``--hogs`` busy processes beside the group.

False alarms: the same worker without a stall, ``--steps`` steps, while ``--spinners`` busy Python processes load
the 2 cores (load average above 4), with the same floor; any exit 70 is a false alarm. Printed: the runs, false
alarms, and the load average seen.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness, procs

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "stall.py"
VERDICT = re.compile(r"no process made progress for ([\d.]+) s \(bound ([\d.]+) s")


def launch(
    out: str, steps: int, env: dict[str, str], peer_timeout: float = 10
) -> tuple[subprocess.CompletedProcess, float]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full.pop("XLA_FLAGS", None)
    argv = [sys.executable, "-m", "jddp.launch", "-n", "2", "--peer-timeout", f"{peer_timeout:g}", str(WORKER), out]
    argv.append(str(steps))
    done = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    return done, time.time()


def detection(how: str, floor: float, repeats: int, peer_timeout: float = 10, hogs: int = 0) -> dict:
    bounds, quiets, latencies = [], [], []
    with procs.busy_processes(hogs):
        for _ in range(repeats):
            _detect_once(how, floor, peer_timeout, bounds, quiets, latencies)
    if latencies:
        over = [lat - b for lat, b in zip(latencies, bounds, strict=True)]
        print(
            f"  stall in {how:<5} T={peer_timeout:g} s, {hogs} hogs: {len(latencies)}/{repeats} named; bound median "
            f"{statistics.median(bounds):.1f} s, judged after {statistics.median(quiets):.1f} s quiet (median), "
            f"stall to group end {statistics.median(latencies):.1f} s median (min {min(latencies):.1f}, max "
            f"{max(latencies):.1f}); over the bound: median {statistics.median(over):.1f} s, max {max(over):.1f} s; "
            f"load {os.getloadavg()[0]:.1f}"
        )
    return {"how": how, "peer_timeout": peer_timeout, "hogs": hogs, "repeats": repeats, "bounds": bounds,
            "quiets": quiets, "latencies": latencies}  # fmt: skip


def _detect_once(how: str, floor: float, peer_timeout: float, bounds: list, quiets: list, latencies: list) -> None:
    with tempfile.TemporaryDirectory() as out:
        env = {"STALL": how, "STALL_AT": "20", "JDDP_STALL_FLOOR": str(floor), "JDDP_FLIGHT_DIR": out}
        done, ended = launch(out, 200, env, peer_timeout)
        stalled = re.search(r"STALLING 20 ([\d.]+)", done.stdout)
        verdict = VERDICT.search(done.stderr)
        if done.returncode != 70 or stalled is None or verdict is None:
            print(f"  {how}: unexpected end (exit {done.returncode}):\n{done.stderr[-2000:]}")
            return
        quiet, bound = map(float, verdict.groups())
        bounds.append(bound)
        quiets.append(quiet)
        latencies.append(ended - float(stalled.group(1)))


def false_alarms(floor: float, repeats: int, steps: int, spinners: int) -> dict:
    alarms, runs, loads = 0, 0, []
    with procs.busy_processes(spinners):
        time.sleep(20)  # let the load average climb
        for loop in ("fit", "hand"):
            for _ in range(repeats):
                with tempfile.TemporaryDirectory() as out:
                    env = {"STALL": "none", "JDDP_STALL_FLOOR": str(floor), "JDDP_FLIGHT_DIR": out}
                    if loop == "hand":
                        env["LOOP"] = "hand"
                    loads.append(os.getloadavg()[0])
                    done, _ = launch(out, steps, env)
                    runs += 1
                    if done.returncode == 70:
                        alarms += 1
                        print(f"  FALSE ALARM ({loop}):\n{done.stderr[-1500:]}")
                    elif done.returncode != 0:
                        print(f"  run failed (exit {done.returncode}):\n{done.stderr[-1500:]}")
                    loads.append(os.getloadavg()[0])
    print(
        f"  no stall, {steps} steps, floor {floor:g} s, {spinners} busy processes: {alarms} false alarms in {runs} "
        f"runs (fit and a hand-written loop); 1-min load average {min(loads):.1f} to {max(loads):.1f}"
    )
    return {"runs": runs, "false_alarms": alarms, "loads": loads}


QUICK: dict[str, Any] = {
    "repeats": 1,
    "steps": 50,
    "spinners": 0,
    "peer_timeouts": "10",
    "hogs": "0",
    "no_false_alarms": True,
}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--floor", type=float, default=3.0, help="JDDP_STALL_FLOOR for every run (s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--spinners", type=int, default=4)
    parser.add_argument("--peer-timeouts", default="10,30,60", help="peer timeouts to measure detection at (s)")
    parser.add_argument("--hogs", default="0,2", help="busy processes beside the group, for each detection run")
    parser.add_argument("--no-false-alarms", action="store_true", help="skip the false-alarm runs")
    return parser


def bench(args: argparse.Namespace) -> Any:
    print(f"stall detector: floor {args.floor:g} s, 2 processes (a watchdog round is min(T/10, 1 s))")
    rows = []
    for timeout in (float(t) for t in args.peer_timeouts.split(",")):
        for hogs in (int(h) for h in args.hogs.split(",")):
            rows.append(detection("spin", args.floor, args.repeats, timeout, hogs))
    rows.append(detection("data", args.floor, args.repeats))
    alarms = None if args.no_false_alarms else false_alarms(args.floor, args.repeats, args.steps, args.spinners)
    return {"detection": rows, "false_alarms": alarms}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
