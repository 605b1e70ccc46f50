"""How long from the wake to a hand-written loop's first step, with its step compiled in standby and without?

Time from the wake of the standby processes to the first step of a hand-written loop (``DataParallel``,
``DataLoader``, ``Checkpointer``; no ``jddp.fit``), with the step compiled before standing by
(``jddp.engine.ahead``, the default) and without (the compilation after the wake, as before).

    python -m benchmarks standby_compile [--repeats 10] [--modes "ahead,after,ahead nocache,after nocache"]

Runs ``benchmarks/hand_loop.py`` (a 64-512-512-512-10 MLP, AdamW, global batch 64) under
``jddp launch -n 2 --max-restarts 1`` and has its process 1 SIGKILL itself after step 10 once the launcher says its
standby processes stand by; the restart wakes them. Arms, in ``abba`` order round by round: ``ahead`` (compiled in
standby) and ``after`` (``--no-ahead``), each with jddp's compilation cache in a directory of the run (attempt 0
fills it: the woken process's compilation is a cache hit that still traces and lowers) or, with `` nocache``,
``JDDP_COMPILATION_CACHE=0`` (a full compilation). From the woken processes' notes (the slower of the two): wake
to the first step's end (``JDDP_ATTEMPT_START`` to it), the first step alone (restore's end to it), the kill to the
first step, and the compilations counted around the first step (0 when compiled ahead). Prints each arm's median,
min and max, the paired comparison of ``ahead`` against ``after`` and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "hand_loop.py"
STANDBY_READY = "standby process(es) of the next attempt ready: compiled, waiting before their restore"
WOKEN = "woken from standby"
KILL_AFTER = 10
FIGURES = ("wake_to_first_step_s", "first_step_s", "kill_to_first_step_s")


def one_run(mode: str, peer_timeout: float) -> dict[str, float] | None:
    """One run in ``mode`` (``ahead``/``after``, `` nocache`` in it for ``JDDP_COMPILATION_CACHE=0``): the woken
    attempt's figures, or None (printed why) when the run failed or its restart was not woken from standby."""
    with tempfile.TemporaryDirectory() as run_dir:
        ready = Path(run_dir) / "ready"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "KILL_ONCE": f"{KILL_AFTER}:{ready}"}
        env.pop("XLA_FLAGS", None)
        env["JDDP_COMPILATION_CACHE"] = "0" if "nocache" in mode else f"{run_dir}/xla"
        env["JDDP_SNAPSHOT_DIR"] = f"{run_dir}/memory"
        arm = ["--no-ahead"] if mode.startswith("after") else []
        argv = [sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", "1", "--peer-timeout",
                str(peer_timeout), str(SCRIPT), run_dir, *arm]  # fmt: skip
        launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                    cwd=ROOT)  # fmt: skip
        said: list[str] = []

        def read() -> None:
            assert launcher.stderr is not None
            for line in launcher.stderr:
                said.append(line)
                if STANDBY_READY in line:
                    ready.touch()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            launcher.wait(timeout=600)
        finally:
            if launcher.poll() is None:
                launcher.kill()
            reader.join(10)
        if launcher.returncode != 0 or not any(WOKEN in line for line in said):
            print(f"  {mode}: exit {launcher.returncode}, woken from standby: {any(WOKEN in s for s in said)}; "
                  "not counted", flush=True)  # fmt: skip
            return None
        woken = [json.loads((Path(run_dir) / f"times-1-{p}.json").read_text()) for p in range(2)]
        killed = float((Path(run_dir) / "killed").read_text())
        end = max(t["first_step"] for t in woken)
        return {
            "wake_to_first_step_s": end - max(t["attempt_start"] for t in woken),
            "first_step_s": max(t["first_step"] - t["restored"] for t in woken),
            "kill_to_first_step_s": end - killed,
            "compiles": max(t["compiles"] for t in woken),
            "restored_step": woken[0]["restored_step"],
        }


def summary(results: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    print(f"standby_compile: seconds, the slower woken process of two; load now {os.getloadavg()[0]:.2f}")
    print(f"  {'arm':<16}{'figure':<24}{'median':>8}{'min':>8}{'max':>8}{'runs':>6}  compilations")
    for mode, rows in results.items():
        for key in FIGURES:
            values = [r[key] for r in rows]
            if values:
                compiles = sorted({int(r["compiles"]) for r in rows})
                print(f"  {mode:<16}{key:<24}{statistics.median(values):>8.2f}{min(values):>8.2f}"
                      f"{max(values):>8.2f}{len(values):>6}  {compiles}")  # fmt: skip
    compared: dict[str, Any] = {}
    for cache in ("", " nocache"):
        a, b = results.get(f"ahead{cache}", []), results.get(f"after{cache}", [])
        n = min(len(a), len(b))
        if n:
            c = harness.compare([r["wake_to_first_step_s"] for r in a[:n]], [r["wake_to_first_step_s"] for r in b[:n]])
            compared[f"ahead/after{cache}"] = c
            print(f"  wake to first step, ahead / after{cache}: median of pair ratios {c['median_pair_ratio']:.3f} "
                  f"[{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] over {n} pairs")  # fmt: skip
    return compared


QUICK: dict[str, Any] = {"repeats": 1, "modes": "ahead,after"}  # --quick: one pair


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="rounds; each runs every arm once (abba order)")
    parser.add_argument("--peer-timeout", type=float, default=30.0)
    parser.add_argument("--modes", default="ahead,after,ahead nocache,after nocache",
                        help="comma-separated: ahead or after, each with or without ' nocache'")  # fmt: skip
    return parser


def bench(args: argparse.Namespace) -> Any:
    modes = [m.strip() for m in args.modes.split(",")]
    print(f"standby_compile: {args.repeats} round(s) of {modes}, load {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    for _, mode in harness.abba(modes, args.repeats):
        r = one_run(mode, args.peer_timeout)
        if r is not None:
            results[mode].append(r)
            print(f"  {mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()), flush=True)
    return {"runs": results, "compared": summary(results)}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
