"""The stall detector: how fast a stall is named, and whether a slow run under load ever is.

    python benchmarks/stall_detector.py [--floor 3] [--repeats 3] [--steps 500] [--spinners 4]

Detection: ``tests/workers/stall.py`` under ``jddp launch -n 2``; process 1 stalls at step 20 in its data loading
(``STALL=data``, under ``fit``) or in a Python loop of its own (``STALL=spin``, a hand-written loop). Printed: the
learned bound, the quiet time the watchdog judged, and the time from the stall to the group's end (the process's
own ``STALLING`` time stamp to the launcher's exit), medians over the repeats.

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "stall.py"
VERDICT = re.compile(r"no process made progress for ([\d.]+) s \(bound ([\d.]+) s")


def launch(out: str, steps: int, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    full.pop("XLA_FLAGS", None)
    argv = [sys.executable, "-m", "jddp.launch", "-n", "2", "--peer-timeout", "10", str(WORKER), out, str(steps)]
    done = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    return done, time.time()


def detection(how: str, floor: float, repeats: int) -> None:
    bounds, quiets, latencies = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as out:
            env = {"STALL": how, "STALL_AT": "20", "JDDP_STALL_FLOOR": str(floor), "JDDP_FLIGHT_DIR": out}
            done, ended = launch(out, 200, env)
            stalled = re.search(r"STALLING 20 ([\d.]+)", done.stdout)
            verdict = VERDICT.search(done.stderr)
            if done.returncode != 70 or stalled is None or verdict is None:
                print(f"  {how}: unexpected end (exit {done.returncode}):\n{done.stderr[-2000:]}")
                continue
            quiet, bound = map(float, verdict.groups())
            bounds.append(bound)
            quiets.append(quiet)
            latencies.append(ended - float(stalled.group(1)))
    if latencies:
        print(
            f"  stall in {how:<5}: {len(latencies)}/{repeats} named; bound median {statistics.median(bounds):.1f} s, "
            f"judged after {statistics.median(quiets):.1f} s quiet (median), stall to group end "
            f"{statistics.median(latencies):.1f} s median (min {min(latencies):.1f}, max {max(latencies):.1f})"
        )


def false_alarms(floor: float, repeats: int, steps: int, spinners: int) -> None:
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
    alarms, runs, loads = 0, 0, []
    try:
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
    finally:
        for p in load:
            p.kill()
    print(
        f"  no stall, {steps} steps, floor {floor:g} s, {spinners} busy processes: {alarms} false alarms in {runs} "
        f"runs (fit and a hand-written loop); 1-min load average {min(loads):.1f} to {max(loads):.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floor", type=float, default=3.0, help="JDDP_STALL_FLOOR for every run (s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--spinners", type=int, default=4)
    args = parser.parse_args()
    print(f"stall detector: floor {args.floor:g} s, peer timeout 10 s (a watchdog round is 1 s), 2 processes")
    print(f"  load average at the start: {os.getloadavg()[0]:.2f}")
    for how in ("data", "spin"):
        detection(how, args.floor, args.repeats)
    false_alarms(args.floor, args.repeats, args.steps, args.spinners)


if __name__ == "__main__":
    main()
