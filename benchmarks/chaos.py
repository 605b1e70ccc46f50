"""How long from a SIGKILL at any moment to the next attempt's first step, and does the run still end bitwise equal?

Chaos: random SIGKILLs of any worker under ``jddp launch --max-restarts``, at moments drawn in time and in steps.

    python -m benchmarks chaos [--runs 4] [--kills 5] [--seed 0] [--busy 0] [--modes disk,memory]

Trains the MNIST-1D MLP (``examples/mnist1d/train.py``, ``configs/mnist1d_mlp.yaml``, ``--epochs``) under ``jddp
launch -n 2 --max-restarts KILLS`` (``--launch-args`` adds flags, e.g. ``--standby-depth 1``) and SIGKILLs a worker
``--kills`` times per run, one kill per attempt, the victim drawn too. Each kill's moment is drawn from ``--seed``
(printed, so a run can be replayed), one of three ways (``--hows``, default all): ``soon`` (0 to 1 s after the
attempt started: the launcher's start for attempt 0, its line "started processes" for a restart; so a second kill
soon after a restart), ``time`` (1 to ``--time-max`` s after the attempt started) or ``step`` (1 to a span of steps
after the attempt's first step). Each kill is then classed by where it landed: ``start`` (within 1 s of attempt 0's
start), ``restart`` (within 1 s of a restart) or ``later``. Modes, interleaved run by run with the same draws:
``disk`` (``JDDP_SNAPSHOTS=0``: each restart restores the last checkpoint on disk, one every ``--save-every`` steps)
and ``memory`` (the default: in-memory snapshots first). ``--busy N`` runs N busy processes (``while True: pass``)
beside the group for the whole benchmark.

Per kill: the seconds from the kill to the next attempt's first step (the goodput ledger's ``first_step_end``,
``jddp.goodput``; a kill whose next attempt was killed before its first step is "interrupted" and counted under the
next kill), the steps recomputed and where the restore came from. A kill before attempt 0's first step cannot
beat the start-up itself: for those the delay against the uninterrupted run's own first step (both from the
launcher's start) is reported too. Per run: whether the final state is bitwise the uninterrupted run's (the 64-bit
digests of every leaf in the final checkpoint's metadata, ``jddp.checkpoint.digest``). Prints, per class and mode,
the median and p90 of kill to first step, the steps recomputed, the restores, the bitwise count and the load.
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

import numpy as np

from benchmarks import harness, procs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "mnist1d" / "train.py"
CONFIG = ROOT / "configs" / "mnist1d_mlp.yaml"
# in jddp launch's "process(es) 0 (pid 57), ... handed to their spares" and "... woken from standby"
HANDED = re.compile(r"(\d+) \(pid (\d+)\)")
STARTED = "started processes"  # jddp launch's line for every attempt's start
CLASSES = ("start", "restart", "later")
SOON_S = 1.0  # a kill this close to an attempt's start is of class start / restart
HOWS = ("soon", "time", "step")


def final_digests(ckpt: Path) -> tuple[int, list]:
    """The last checkpoint's step and its leaves' digests."""
    step = max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    meta = json.loads((ckpt / str(step) / "meta" / "metadata").read_text())
    return step, meta["digests"]


def running(launcher: int, said: list[tuple[float, str]]) -> list[int]:
    """The launcher's worker processes now (started as ``train.py``, or spares handed a role or woken from standby:
    named by the launcher's lines), by pid."""
    live = procs.descendants(launcher)  # a spare forked by the zygote is the launcher's grandchild
    lines = [line for _, line in list(said) if "handed" in line or "woken" in line]
    handed = {int(pid) for line in lines for _, pid in HANDED.findall(line)}
    return sorted(set(procs.workers(launcher)) | (handed & live))


def draw(rng: random.Random, kills: int, span: int, time_max: float, hows: tuple[str, ...] = HOWS) -> list[dict]:
    """``kills`` kill plans: how (one of ``hows``: ``soon``, ``time``, ``step``), when (seconds or steps), which
    process."""
    plans = []
    for _ in range(kills):
        how = rng.choice(hows)
        when = rng.uniform(0, SOON_S) if how == "soon" else rng.uniform(SOON_S, time_max) if how == "time" else 0
        plans.append({"how": how, "after_s": when, "steps": rng.randint(1, span), "victim": rng.randint(0, 1)})
    return plans


class Run:
    """One launcher under kills: its lines with their times, its ledgers, the kills made."""

    def __init__(self, mode: str, plans: list[dict], args: argparse.Namespace, run_dir: str) -> None:
        self.plans, self.args, self.run_dir = plans, args, Path(run_dir)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)
        if mode == "disk":
            env["JDDP_SNAPSHOTS"] = "0"
        argv = [
            sys.executable, "-m", "jddp.launch", "-n", "2", "--max-restarts", str(len(plans)),
            *args.launch_args.split(),
            str(SCRIPT), f"config={CONFIG}", f"epochs={args.epochs}", "progress=false",
            f"save_every={args.save_every}", f"log_dir={run_dir}/log", f"checkpoint_dir={run_dir}/ckpt",
        ]  # fmt: skip
        self.start = time.time()
        self.launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        self.said: list[tuple[float, str]] = []
        stderr = self.launcher.stderr
        assert stderr is not None  # a pipe
        self.reader = threading.Thread(target=self.read, args=(stderr,), daemon=True)
        self.reader.start()
        self.kills: list[dict] = []

    def read(self, stderr) -> None:
        for line in stderr:
            self.said.append((time.time(), line.decode(errors="replace")))

    def ledgers(self) -> list[Path]:
        from jddp import goodput

        return sorted((self.run_dir / "log" / goodput.LEDGER_DIR).glob("*/attempt-*.ledger"))  # NNNN: in order

    def attempt_start(self, attempt: int) -> float | None:
        """Attempt 0: the launcher's start; a restart: the launcher's line saying it started the processes."""
        starts = [t for t, line in list(self.said) if STARTED in line]
        if attempt == 0:
            return self.start
        return starts[attempt] if len(starts) > attempt else None

    def due(self, plan: dict, started: float, since: float) -> bool:
        """Whether ``plan``'s moment came for the attempt started at ``started`` (its ledger: the one begun after
        ``since``, the previous kill or the launcher's start; goodput numbers ledgers by the run's folder, which a
        kill before the first ledger leaves to the next attempt, so ledgers are matched by time)."""
        from jddp import goodput

        if plan["how"] != "step":
            return time.time() >= started + plan["after_s"]
        read = [goodput.read(p) for p in self.ledgers()]
        return any(r["attempt_start"] > since and r["steps_run"] >= plan["steps"] for r in read)

    def kill_all(self) -> None:
        """Carries out the plans, one per attempt, each once its attempt's processes run and its moment came."""
        killed: set[int] = set()
        for attempt, plan in enumerate(self.plans):
            while self.launcher.poll() is None:
                started = self.attempt_start(attempt)
                pids = running(self.launcher.pid, self.said)
                fresh = len(pids) == 2 and not set(pids) & killed
                since = self.kills[-1]["at"] if self.kills else self.start - 1.0
                if started is not None and fresh and self.due(plan, started, since):
                    os.kill(pids[plan["victim"]], signal.SIGKILL)
                    now = time.time()
                    killed |= set(pids)
                    self.kills.append({**plan, "attempt": attempt, "at": now, "offset": now - started})
                    break
                time.sleep(0.005)

    def finish(self, timeout: float) -> int:
        try:
            self.launcher.wait(timeout=timeout)
        finally:
            if self.launcher.poll() is None:
                self.launcher.kill()
                self.launcher.wait()
        self.reader.join(10)
        return self.launcher.returncode


def path_after(said: list[tuple[float, str]], at: float) -> str | None:
    """How the attempt started after a kill at ``at`` got its processes: ``woken`` (standby), ``forked`` (spares
    forked then from the zygote), ``handed`` (spares prepared before), ``anew`` (started fresh), or None (no attempt
    started)."""
    after = [line for t, line in said if t >= at]
    starts = [i for i, line in enumerate(after) if STARTED in line]
    if not starts:
        return None
    following = after[starts[0] + 1 : starts[0] + 2]
    kinds = ("woken", "forked", "handed")
    return next((kind for kind in kinds if any(kind in line for line in following)), "anew")


def first_step_offset(run_dir: Path, start: float) -> float | None:
    """Seconds from the launcher's start to attempt 0's first step (an uninterrupted run's start-up)."""
    from jddp import goodput

    found = sorted((run_dir / "log" / goodput.LEDGER_DIR).glob("*/attempt-*.ledger"))
    end = goodput.read(found[0])["first_step_end"] if found else 0
    return end - start if end else None


def one_run(mode: str, plans: list[dict], args, reference_start_s: float | None = None) -> dict | None:
    """``plans``: one kill per attempt, in order (``draw``)."""
    from jddp import goodput

    with tempfile.TemporaryDirectory() as run_dir:
        run = Run(mode, plans, args, run_dir)
        try:
            run.kill_all()
        finally:
            code = run.finish(1800)
        if code != 0:
            tail = "".join(line for _, line in run.said[-15:])
            print(f"  {mode}: the run failed (exit {code}); the launcher's last lines:\n{tail}", flush=True)
            return None
        ledgers = run.ledgers()
        read = [goodput.read(p) for p in ledgers]
        accounts = goodput.ledger_accounts(ledgers)
        sources = [goodput.RESTORED_FROM[int(r["restored_from"])] for r in read[1:]]
        kills = []
        for i, kill in enumerate(run.kills):
            # the killed attempt's ledger (begun before the kill, after the previous one), and the next attempt's
            # (begun after the kill, before the next kill): goodput numbers them by the run's folder, not by attempt
            before = run.kills[i - 1]["at"] if i else run.start - 1.0
            until = run.kills[i + 1]["at"] if i + 1 < len(run.kills) else float("inf")
            killed = [j for j, r in enumerate(read) if before < r["attempt_start"] < kill["at"]]
            following = [r for r in read if kill["at"] < r["attempt_start"] < until]
            first = following[0]["first_step_end"] if following else 0
            kind = "later" if kill["offset"] >= SOON_S else "start" if kill["attempt"] == 0 else "restart"
            entry = {**kill, "class": kind, "to_first_step_s": first - kill["at"] if first else None}
            entry["path"] = path_after(run.said, kill["at"])
            before_first = not killed or not read[killed[0]]["first_step_end"]
            if kill["attempt"] == 0 and before_first and first and reference_start_s:
                entry["delay_vs_unkilled_s"] = first - run.start - reference_start_s  # start-up cannot be beaten
            entry["recomputed"] = int(accounts[killed[0]]["recomputed_steps"]) if killed else 0  # none: no step
            kills.append(entry)
        return {
            "kills": kills,
            "sources": sources,
            "final": final_digests(Path(run_dir) / "ckpt"),
            "attempts": len(read),
            "woken": sum("woken from standby" in line for _, line in run.said),
            "first_step_s": first_step_offset(Path(run_dir), run.start),
        }


QUICK: dict[str, Any] = {"runs": 1, "kills": 2, "epochs": 2, "modes": "memory"}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--time-max", type=float, default=8.0, help="a time-drawn kill's latest second (default 8)")
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the group (default 0)")
    parser.add_argument("--hows", default=",".join(HOWS), help="the kinds of moments drawn (default: all three)")
    parser.add_argument("--launch-args", default="", help="more flags for jddp launch, e.g. '--standby-depth 1'")
    parser.add_argument("--modes", default="disk,memory", help="comma-separated: disk, memory (default: both)")
    return parser


def figures(values: list[float]) -> str:
    if not values:
        return "none"
    return (
        f"median {statistics.median(values):.2f} s, p90 {float(np.percentile(values, 90)):.2f} s, "
        f"range [{min(values):.2f}, {max(values):.2f}] (n={len(values)})"
    )


def bench(args: argparse.Namespace) -> Any:
    with procs.busy_processes(args.busy):
        return measure(args)


def measure(args: argparse.Namespace) -> Any:
    rng = random.Random(args.seed)
    print(
        f"chaos: seed {args.seed}, {args.runs} runs x {args.kills} kills per mode, {args.busy} busy process(es), "
        f"launch flags {args.launch_args!r}, load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    reference = one_run("memory", [], args)
    assert reference is not None, "the uninterrupted run failed"
    print(
        f"  uninterrupted: final step {reference['final'][0]}, first step {reference['first_step_s']:.2f} s after "
        "the launcher's start",
        flush=True,
    )
    steps_per_epoch = reference["final"][0] // args.epochs
    span = max(1, (reference["final"][0] - steps_per_epoch) // max(1, args.kills))
    modes = [m.strip() for m in args.modes.split(",")]
    totals: dict[str, dict] = {m: {"kills": [], "sources": [], "bitwise": 0, "runs": 0, "woken": 0} for m in modes}
    for i in range(args.runs):
        hows = tuple(h.strip() for h in args.hows.split(","))
        if not set(hows) <= set(HOWS):
            raise ValueError(f"--hows must name some of {', '.join(HOWS)}, got {args.hows!r}.")
        plans = draw(rng, args.kills, span, args.time_max, hows)
        for mode in modes if i % 2 == 0 else modes[::-1]:
            r = one_run(mode, plans, args, reference["first_step_s"])
            if r is None:
                continue
            t = totals[mode]
            t["runs"] += 1
            t["kills"] += r["kills"]
            t["sources"] += r["sources"]
            t["bitwise"] += r["final"] == reference["final"]
            t["woken"] += r["woken"]
            each = "; ".join(
                f"{k['how']}->{k['class']} +{k['offset']:.2f}s: "
                + (f"{k['to_first_step_s']:.2f} s" if k["to_first_step_s"] is not None else "interrupted")
                + (f" (vs unkilled start +{k['delay_vs_unkilled_s']:.2f} s)" if "delay_vs_unkilled_s" in k else "")
                + f", {k['path']}, recomputed {k['recomputed']}"
                for k in r["kills"]
            )
            print(
                f"  {mode} run {i}: {each}; restored from {r['sources']}, {r['woken']} restart(s) woken from "
                f"standby, bitwise {r['final'] == reference['final']}",
                flush=True,
            )
    print(f"totals (load at the end {os.getloadavg()[0]:.2f}, {args.busy} busy process(es)):")
    results: dict[str, Any] = {"reference_first_step_s": reference["first_step_s"], "modes": {}}
    for mode, t in totals.items():
        counts = ", ".join(f"{s} {t['sources'].count(s)}" for s in sorted(set(t["sources"])))
        recomputed = [k["recomputed"] for k in t["kills"] if k["recomputed"] is not None]
        print(f"  {mode}: {len(t['kills'])} kills in {t['runs']} runs; restores from: {counts}; {t['woken']} "
              f"restart(s) woken from standby; bitwise equal in {t['bitwise']} of {t['runs']} runs; steps "
              f"recomputed per kill: {sorted(set(recomputed))}, max {max(recomputed, default=0)}")  # fmt: skip
        by_class = {}
        for kind in CLASSES:
            ks = [k for k in t["kills"] if k["class"] == kind]
            values = [k["to_first_step_s"] for k in ks if k["to_first_step_s"] is not None]
            interrupted = sum(k["to_first_step_s"] is None for k in ks)
            paths = [k.get("path") for k in ks if k["to_first_step_s"] is not None]
            print(f"    {kind}: kill to first step {figures(values)}; interrupted {interrupted}")
            for path in ("woken", "forked", "handed", "anew"):
                each = [k["to_first_step_s"] for k in ks if k["to_first_step_s"] is not None and k.get("path") == path]
                if each:
                    print(f"      next attempt {path}: {figures(each)}")
            delays = [k["delay_vs_unkilled_s"] for k in ks if "delay_vs_unkilled_s" in k]
            if delays:
                print(f"    {kind}, before attempt 0's first step: first step later than unkilled by {figures(delays)}")
            by_class[kind] = {
                "to_first_step_s": values,
                "paths": paths,
                "interrupted": interrupted,
                "delay_vs_unkilled_s": delays,
            }
        results["modes"][mode] = {
            "classes": by_class,
            "recomputed": recomputed,
            "sources": t["sources"],
            "bitwise": t["bitwise"],
            "runs": t["runs"],
            "woken": t["woken"],
        }
    return results


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
