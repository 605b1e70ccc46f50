"""How long from a SIGKILL to the restarted group's first step, with and without the compilation cache and spares?

Restart time: from a SIGKILL to the first step of the restarted group, with and without the compilation cache,
with and without the launcher's spare processes.

    python -m benchmarks restart [--repeats 10] [--seed 0] [--no-fresh] [--modes "warm,warm no-spares disk"]

Runs the MNIST-1D MLP (``examples/mnist1d/train.py``, ``configs/mnist1d_mlp.yaml``, 10 epochs, a checkpoint every
20 steps) under ``jddp launch -n 2 --max-restarts 3``, and SIGKILLs one worker once per run, at a step and a
process drawn from ``--seed`` (printed, so a run can be replayed): the first step past the drawn one (31 to 60) at
which the launcher's spares are ready, in standby where they stand by (it says so on stderr), so that a kill
finds them as a crash in a long run would.

Modes, interleaved run by run, by the compilation cache: ``warm`` (jddp's default cache, in a directory filled by
one run first), ``cold`` (the default cache, in a directory empty when the run starts: a first run on a fresh
machine, whose first attempt fills it) and ``nocache`` (``JDDP_COMPILATION_CACHE=0``: nothing is kept, every
attempt compiles); each with spares in standby (the default), ``no-standby`` (spares with their imports done
only, ``--no-standby``) or ``no-spares`` (every restart starts its processes anew, ``--no-spares``).

From the goodput ledgers (``jddp.goodput``): the time from the kill to the restarted attempt's first step, and its
parts: the old group's end (noticed and stopped), the launcher's restart, the new processes' start (imports,
``initialize``, the model: a spare has done the imports, a standby process all of it), the restore, and the first
step (compilation, which a standby process did ahead). Prints each mode's median, min and max, the parts' medians
and the load average; then (unless ``--no-fresh``) a fresh start's time to the first step, cold and warm.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
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


SPARES_READY = "spare process(es) ready for a restart"  # jddp launch's lines (stderr)
STANDBY_READY = "standby process(es) of the next attempt ready: compiled, waiting before their restore"
HANDED = "handed to their spares"
WOKEN = "woken from standby"


def one_run(mode: str, cache_dir: str, kill_step: int | None, victim: int, peer_timeout: float) -> dict | None:
    """One run in ``mode`` (``warm``/``cold``/``nocache``; `` no-spares`` or `` no-standby`` in it for the flag,
    `` disk`` for ``JDDP_SNAPSHOTS=0``: the restore from disk), killed after ``kill_step`` (None: no kill, the fresh
    start's first step only)."""
    from jddp import goodput

    spares = "no-spares" not in mode
    standby = spares and "no-standby" not in mode
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)
        env["JDDP_COMPILATION_CACHE"] = {"nocache": "0", "cold": f"{run_dir}/xla"}.get(mode.split()[0], cache_dir)
        if "disk" in mode:
            env["JDDP_SNAPSHOTS"] = "0"
        argv = [
            sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", "3", "--peer-timeout", str(peer_timeout),
            *([] if spares else ["--no-spares"]), *([] if standby or not spares else ["--no-standby"]),
            str(SCRIPT), f"config={CONFIG}", "epochs=10", "progress=false", "save_every=20",
            f"log_dir={run_dir}/log", f"checkpoint_dir={run_dir}/ckpt",
        ]  # fmt: skip
        launcher = subprocess.Popen(
            argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        said: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert launcher.stderr is not None
            for line in launcher.stderr:
                said.append(line)
                if (STANDBY_READY if standby else SPARES_READY) in line:
                    ready.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        ledgers_of = lambda: sorted((Path(run_dir) / "log" / goodput.LEDGER_DIR).glob("*/attempt-*.ledger"))
        ledger0 = Path("/nonexistent")  # the run's folder is named by its id (jddp.goodput): found once it exists
        killed_at = None
        try:
            while kill_step is not None and killed_at is None and launcher.poll() is None:
                time.sleep(0.02)
                ledger0 = next(iter(ledgers_of()), ledger0)
                if (spares and not ready.is_set()) or not ledger0.exists():
                    continue
                if goodput.read(ledger0)["last_step"] >= kill_step:
                    pids = procs.workers(launcher.pid)
                    if len(pids) == 2:
                        os.kill(pids[victim], signal.SIGKILL)
                        killed_at = time.time()
            launcher.wait(timeout=600)
        finally:
            if launcher.poll() is None:
                launcher.kill()
            reader.join(10)
        if launcher.returncode != 0:
            print(f"  {mode}: the run failed (exit {launcher.returncode})", flush=True)
            return None
        ledgers = ledgers_of()
        if kill_step is None:
            only = goodput.read(ledgers[0])
            return {"first_step_s": only["first_step_end"] - only["attempt_start"]}
        if len(ledgers) != 2 or killed_at is None:
            print(f"  {mode}: expected one restart, found {len(ledgers)} attempts", flush=True)
            return None
        old, new = goodput.read(ledgers[0]), goodput.read(ledgers[1])
        woken, handed = (any(text in line for line in said) for text in (WOKEN, HANDED))
        used = "standby" if woken else "spares" if handed else ""
        if used != ("standby" if standby else "spares" if spares else ""):
            print(f"  {mode}: the restart used {used or 'no spares'}", flush=True)
            return None
        return {
            "kill_to_first_step_s": new["first_step_end"] - killed_at,
            "group_end_s": new["previous_end"] - killed_at,
            "relaunch_s": new["attempt_start"] - new["previous_end"],
            "startup_s": new["fit_start"] - new["attempt_start"],
            "restore_s": new["restore_s"],
            "first_step_s": new["first_step_end"] - new["fit_start"] - new["restore_s"],
            "redone_steps": old["last_step"] - new["first_step"],
            "from_memory": float(goodput.RESTORED_FROM[int(new["restored_from"])] in ("memory", "peer")),
            "killed_after_step": old["last_step"],
            "restored_step": new["first_step"],
        }


def summary(results: dict[str, list[dict]]) -> None:
    print(f"kill to the first step of the restarted group (seconds), load at the end {os.getloadavg()[0]:.2f}:")
    print(f"  {'mode':<16}{'median':>8}{'min':>8}{'max':>8}{'kills':>7}")
    for mode, rows in results.items():
        if rows:
            times = [r["kill_to_first_step_s"] for r in rows]
            print(f"  {mode:<16}{statistics.median(times):>8.2f}{min(times):>8.2f}{max(times):>8.2f}{len(times):>7}")
    print("medians of the parts (seconds):")
    keys = [k for k in next(iter(v for v in results.values() if v), [{}])[0] if k != "kill_to_first_step_s"]
    print("  " + f"{'':<16}" + "".join(f"{k:>18}" for k in keys))
    for mode, rows in results.items():
        if rows:
            print("  " + f"{mode:<16}" + "".join(f"{statistics.median(r[k] for r in rows):>18.2f}" for k in keys))


QUICK: dict[str, Any] = {"repeats": 1, "modes": "warm", "no_fresh": True}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-timeout", type=float, default=30.0)
    parser.add_argument("--no-fresh", action="store_true", help="skip the fresh starts without a kill")
    parser.add_argument(
        "--modes",
        default="warm,warm no-standby,warm no-spares,cold,nocache,nocache no-standby",
        help="comma-separated: warm, cold or nocache, with ' no-standby', ' no-spares' and ' disk' "
        "(JDDP_SNAPSHOTS=0: the restore from disk, as before in-memory snapshots) in it",
    )
    return parser


def bench(args: argparse.Namespace) -> Any:
    rng = random.Random(args.seed)
    modes = [m.strip() for m in args.modes.split(",")]
    print(f"restart benchmark: seed {args.seed}, {args.repeats} kills per mode, load {os.getloadavg()[0]:.2f}")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    first_steps: dict[str, list[float]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as cache_dir:
        one_run("warm", cache_dir, None, 0, args.peer_timeout)  # fills the cache
        for i in range(args.repeats):
            kill_step, victim = rng.randint(31, 60), rng.randint(0, 1)
            for mode in modes if i % 2 == 0 else modes[::-1]:
                r = one_run(mode, cache_dir, kill_step, victim, args.peer_timeout)
                if r is not None:
                    results[mode].append(r)
                    print(f"  {mode}: kill process {victim} at step {kill_step} or after: " + ", ".join(
                        f"{k} {v:.2f}" for k, v in r.items()), flush=True)  # fmt: skip
        for i in range(0 if args.no_fresh else args.repeats):  # a fresh start, no kill: with and without the cache
            for mode in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
                r = one_run(mode, cache_dir, None, 0, args.peer_timeout)
                if r is not None:
                    first_steps[mode].append(r["first_step_s"])
    summary(results)
    for mode, times in first_steps.items():
        if times:
            print(
                f"  fresh start to the first step, {mode} cache: median {statistics.median(times):.2f} s "
                f"(min {min(times):.2f}, max {max(times):.2f}) over {len(times)} runs"
            )
    return {"kills": results, "fresh_first_step_s": first_steps}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
