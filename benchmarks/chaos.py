"""Does a run under random SIGKILLs end bitwise equal to an uninterrupted one, and what does each kill cost?

Chaos: random SIGKILLs of any worker under ``jddp launch --max-restarts``, restored from disk or from memory.

    python -m benchmarks chaos [--runs 4] [--kills 5] [--seed 0] [--save-every 20]

Trains the MNIST-1D MLP (``examples/mnist1d/train.py``, ``configs/mnist1d_mlp.yaml``, ``--epochs``) under
``jddp launch -n 2 --max-restarts KILLS`` and SIGKILLs a worker ``--kills`` times per run, each at a step drawn from
``--seed`` (printed, so a run can be replayed) once the running attempt is past it, the victim drawn too. Modes,
interleaved run by run with the same draws: ``disk`` (``JDDP_SNAPSHOTS=0``: each restart restores the last checkpoint
on disk, one every ``--save-every`` steps) and ``memory`` (the default: in-memory snapshots first). Per kill, from
the goodput ledgers (``jddp.goodput``): the steps recomputed (taken again after the restore) and where the restore
came from. Per run: whether the final state is bitwise the uninterrupted run's (the 64-bit digests of every leaf in
the final checkpoint's metadata, ``jddp.checkpoint.digest``). Prints the totals and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
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
# in jddp launch's "process(es) 0 (pid 57), ... handed to their spares" and "... woken from standby"
HANDED = re.compile(r"(\d+) \(pid (\d+)\)")


def final_digests(ckpt: Path) -> tuple[int, list]:
    """The last checkpoint's step and its leaves' digests."""
    step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    meta = json.loads((ckpt / str(step) / "meta" / "metadata").read_text())
    return step, meta["digests"]


def running(launcher: int, said: list[str]) -> list[int]:
    """The launcher's worker processes now (started as ``train.py``, or spares handed a role or woken from standby:
    named by the launcher's lines), by pid."""
    live = set(procs.children(launcher))
    handed = {int(pid) for line in list(said) for _, pid in HANDED.findall(line) if "handed" in line or "woken" in line}
    return sorted(set(procs.workers(launcher)) | (handed & live))


def one_run(mode: str, kills: list[tuple[int, int]], args) -> dict | None:
    """``kills``: (step, victim) pairs, in step order; each is carried out once the running attempt is past it."""
    from jddp import goodput

    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)
        if mode == "disk":
            env["JDDP_SNAPSHOTS"] = "0"
        argv = [
            sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", str(len(kills)),
            str(SCRIPT), f"config={CONFIG}", f"epochs={args.epochs}", "progress=false",
            f"save_every={args.save_every}", f"log_dir={run_dir}/log", f"checkpoint_dir={run_dir}/ckpt",
        ]  # fmt: skip
        launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        said: list[str] = []
        stderr = launcher.stderr
        assert stderr is not None  # a pipe
        threading.Thread(target=lambda: said.extend(line.decode() for line in stderr), daemon=True).start()
        ledgers = lambda: sorted((Path(run_dir) / "log" / goodput.LEDGER_DIR).glob("*/attempt-*.ledger"))
        done = 0
        try:
            while done < len(kills) and launcher.poll() is None:
                time.sleep(0.01)
                found = ledgers()
                if len(found) != done + 1:  # the attempt that takes the next kill has not started yet
                    continue
                step, victim = kills[done]
                if goodput.read(found[-1])["last_step"] >= step:
                    pids = running(launcher.pid, said)
                    if len(pids) == 2:
                        os.kill(pids[victim], signal.SIGKILL)
                        done += 1
            launcher.wait(timeout=1800)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        if launcher.returncode != 0:
            print(f"  {mode}: the run failed (exit {launcher.returncode})", flush=True)
            return None
        accounts = goodput.ledger_accounts(ledgers())
        records = [json.loads(line) for line in (Path(run_dir) / "log" / "metrics.jsonl").read_text().splitlines()]
        sources = [goodput.RESTORED_FROM[int(goodput.read(p)["restored_from"])] for p in ledgers()[1:]]
        return {
            "recomputed": [int(a["recomputed_steps"]) for a in accounts[:-1]],
            "sources": sources,
            "final": final_digests(Path(run_dir) / "ckpt"),
            "attempts": len(accounts),
            "records": len(records),
            "woken": sum("woken from standby" in line for line in said),
        }


QUICK: dict[str, Any] = {"runs": 1, "kills": 1, "epochs": 2}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--modes", default="disk,memory", help="comma-separated: disk, memory (default: both)")
    return parser


def bench(args: argparse.Namespace) -> Any:
    rng = random.Random(args.seed)
    print(f"chaos: seed {args.seed}, {args.runs} runs x {args.kills} kills per mode, load {os.getloadavg()[0]:.2f}")
    reference = one_run("memory", [], args)
    assert reference is not None, "the uninterrupted run failed"
    print(f"  uninterrupted: final step {reference['final'][0]}", flush=True)
    steps_per_epoch = reference["final"][0] // args.epochs
    modes = [m.strip() for m in args.modes.split(",")]
    totals: dict[str, dict] = {m: {"recomputed": [], "sources": [], "bitwise": 0, "runs": 0, "woken": 0} for m in modes}
    for i in range(args.runs):
        last = reference["final"][0] - steps_per_epoch  # every kill leaves an epoch to go
        kills = sorted((rng.randint(5, last), rng.randint(0, 1)) for _ in range(args.kills))
        kills = [(step + k, victim) for k, (step, victim) in enumerate(kills)]  # one kill per attempt, in order
        for mode in modes if i % 2 == 0 else modes[::-1]:
            r = one_run(mode, kills, args)
            if r is None:
                continue
            t = totals[mode]
            t["runs"] += 1
            t["recomputed"] += r["recomputed"]
            t["sources"] += r["sources"]
            t["bitwise"] += r["final"] == reference["final"]
            t["woken"] += r["woken"]
            print(
                f"  {mode}: kills {kills}: recomputed {r['recomputed']}, restored from {r['sources']}, "
                f"{r['woken']} restart(s) woken from standby, bitwise {r['final'] == reference['final']}",
                flush=True,
            )
    print(f"totals (load at the end {os.getloadavg()[0]:.2f}):")
    for mode, t in totals.items():
        counts = ", ".join(f"{s} {t['sources'].count(s)}" for s in sorted(set(t["sources"])))
        if t["recomputed"]:
            print(
                f"  {mode}: {len(t['recomputed'])} kills, steps recomputed per kill: median "
                f"{statistics.median(t['recomputed']):g}, mean {statistics.mean(t['recomputed']):.2f}, max "
                f"{max(t['recomputed'])}; restores from: {counts}; {t['woken']} restart(s) woken from standby; "
                f"bitwise equal to the uninterrupted run in {t['bitwise']} of {t['runs']} runs"
            )
    return totals


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
