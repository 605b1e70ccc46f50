"""How long after a process fails does ``jddp launch`` end, against its bound T + 10 s?

The failure bound at the launcher's exit: from a process's failure to ``jddp launch``'s end, against T + 10 s.

    python -m benchmarks failure_bound [--repeats 2] [--peer-timeouts 10,30,60] [--hogs 0,2]
                                       [--kinds sigkill,sigstop,exit0]

``tests/workers/group.py end 1 HOW`` under ``jddp launch -n 2 --peer-timeout T`` (default kill grace): process 1
trains, prints ``ENDING <time>`` at step 3 and then ends by ``HOW``: ``sigkill`` (SIGKILL to itself), ``sigstop``
(SIGSTOP to itself: frozen, its heartbeat stops, only its launcher can end it) or ``exit0`` (returns from the
script early, exit 0, while process 0 still needs it). Printed for each peer timeout, quiet and with ``--hogs``
busy processes beside the group (``while True: pass``, one per core on a 2-core machine): the launcher's exit
code (0 would be a failed run reported as success), the time from ``ENDING`` to the launcher's exit, median and
maximum over the repeats, that time minus T, and the 1-minute load average at the end of the row.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness, procs

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "workers" / "group.py"
ENDING = re.compile(r"ENDING ([\d.]+)")


def run_once(how: str, peer_timeout: float) -> tuple[int, float] | None:
    """One run; returns (the launcher's exit code, seconds from the failure to its exit), or None."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    argv = [sys.executable, "-m", "jddp.launch", "-n", "2", "--peer-timeout", f"{peer_timeout:g}"]
    argv += [str(WORKER), "end", "1", how]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    ended = time.time()
    found = ENDING.search(done.stdout)
    if found is None:
        print(f"    {how}: no ENDING line (exit {done.returncode}):\n{done.stderr[-1500:]}", flush=True)
        return None
    return done.returncode, ended - float(found.group(1))


def row(how: str, peer_timeout: float, hogs: int, repeats: int) -> dict:
    results = []
    with procs.busy_processes(hogs):
        for _ in range(repeats):
            result = run_once(how, peer_timeout)
            if result is not None:
                results.append(result)
    if not results:
        return {"how": how, "peer_timeout": peer_timeout, "hogs": hogs, "runs": []}
    codes = sorted({code for code, _ in results})
    times = [t for _, t in results]
    print(
        f"  {how:<8} T={peer_timeout:>3g} s, {hogs} hogs: launcher exit {codes}; failure to launcher exit: median "
        f"{statistics.median(times):.1f} s, max {max(times):.1f} s (T + {statistics.median(times) - peer_timeout:.1f}"
        f" / T + {max(times) - peer_timeout:.1f}; bound T + 10) over {len(times)} runs; load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    return {"how": how, "peer_timeout": peer_timeout, "hogs": hogs, "exit_codes": codes, "seconds": times}


QUICK: dict[str, Any] = {"repeats": 1, "peer_timeouts": "10", "hogs": "0", "kinds": "sigkill"}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peer-timeouts", default="10,30,60", help="peer timeouts T (s)")
    parser.add_argument("--hogs", default="0,2", help="busy processes beside the group, for each row")
    parser.add_argument("--kinds", default="sigkill,sigstop,exit0", help="how process 1 ends")
    return parser


def bench(args: argparse.Namespace) -> Any:
    print("failure bound at jddp launch's exit, 2 processes")
    rows = []
    for timeout in (float(t) for t in args.peer_timeouts.split(",")):
        for hogs in (int(h) for h in args.hogs.split(",")):
            for how in args.kinds.split(","):
                rows.append(row(how, timeout, hogs, args.repeats))
    return {"rows": rows}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
