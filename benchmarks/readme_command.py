"""How long does the README's main command take, and what does it reach (the figures the README quotes)?

Times the README's main command and writes its figures to a JSON file the README quotes.

    python -m benchmarks readme_command [--out benchmarks/results/readme_command.json]

Runs ``jddp launch -n 2 --devices-per-process 4 -m examples.mnist1d.train config=configs/mnist1d_cnn.yaml`` (the
README's command once installed) from the repository's root, into a fresh ``log_dir`` so that no earlier run is
continued, and records: the wall time of the command, the final metrics the example prints on its ``result:`` line
(steps, test accuracy, training time), the machine (cores, CPU model), the date, the commit and the load average
before and after. ``tests/test_doc_numbers.py`` checks that the README quotes these figures as written here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "jddp launch -n 2 --devices-per-process 4 -m examples.mnist1d.train config=configs/mnist1d_cnn.yaml"


def _result(stdout: str) -> dict:
    """The example's ``result: k=v ...`` line as a dict of numbers."""
    line = next((x for x in stdout.splitlines() if "result: " in x), None)
    if line is None:
        raise RuntimeError(f"The command printed no 'result:' line:\n{stdout[-3000:]}")
    pairs = (item.split("=", 1) for item in line.split("result: ", 1)[1].split())
    return {k: float(v) if re.fullmatch(r"-?[\d.e+-]+", v) else v for k, v in pairs}


QUICK: dict[str, Any] = {}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks readme_command", description="Times the README command.")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/readme_command.json"), help="the JSON written")
    return p


def bench(args: argparse.Namespace) -> Any:
    jddp = str(Path(sys.executable).with_name("jddp"))
    with tempfile.TemporaryDirectory(prefix="jddp-readme-") as tmp:
        argv_run = [jddp, *shlex.split(COMMAND)[1:], f"log_dir={tmp}/run", "progress=false"]
        load_before = os.getloadavg()
        start = time.perf_counter()
        done = subprocess.run(argv_run, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - start
        load_after = os.getloadavg()
    if done.returncode != 0:
        raise RuntimeError(f"{COMMAND} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    figures = {
        "command": COMMAND,
        "wall_s": round(wall, 2),
        "result": _result(done.stdout),
        "date": datetime.datetime.now(datetime.UTC).strftime("%d %b %Y"),
        "commit": commit.stdout.strip(),
        "machine": {"cores": os.cpu_count(), "cpu": harness.cpu_model()},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return figures


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
