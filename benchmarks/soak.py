"""Does a long run that saves often keep every process's memory flat?

    python -m benchmarks soak [--steps 20000] [--save-every 10] [--interval 3] [--no-malloc-tuning]

Runs the MNIST-1D MLP (``examples/mnist1d/train.py``, ``configs/mnist1d_mlp.yaml``) under ``jddp launch -n 2``
for at least ``--steps`` steps (the example trains by epochs: as many epochs as reach them), with an async
checkpoint every ``--save-every`` steps (``max_to_keep`` 3, the default) and the example's own evaluation after
every epoch and a metrics record every 10 steps. Every ``--interval`` seconds it samples each worker's resident
memory (``VmRSS`` in ``/proc/<pid>/status``, and the anonymous part, ``Anonymous`` in ``smaps_rollup``), its open
file descriptors and threads, with the step reached (process 0's goodput ledger, ``jddp.goodput``). It prints,
per process, the slope of RSS and of anonymous memory over the steps after warm-up (a least-squares line through
the samples of the second half of the steps, before the last step's, in MB per 1000 steps; the goal is under 0.2),
the memory at the start and end of that half, and the descriptors and threads first and last; the load average at
the start and the end, and the run's last line (``jddp.fit``'s: the steps, and the in-memory snapshots taken and
their interval at the end). ``--out FILE`` also writes every sample as JSON.

In-memory snapshots (``jddp.checkpoint.snapshot``) are jddp's default under ``jddp launch``: on, their interval
adapting to their cost (every step where they cost little); ``--snapshot-every N`` fixes the interval
(``JDDP_SNAPSHOT_EVERY``; 1 for the issue's soak), ``--no-snapshots`` turns them off (``JDDP_SNAPSHOTS=0``), to
tell their memory from the saves'. ``--set key=value`` passes an override to the example
(repeatable).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness, procs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "mnist1d" / "train.py"
CONFIG = ROOT / "configs" / "mnist1d_mlp.yaml"
TRAIN_EXAMPLES, GLOBAL_BATCH = 4000, 128  # the example's defaults: 80% of 5000 examples, 128 per step


def sample(pid: int) -> dict[str, float] | None:
    """RSS and anonymous memory (MB), open descriptors and threads of ``pid``; None once it is gone."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
        rollup = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    kb = lambda text: float(text.split()[0]) / 1024  # "1234 kB" -> MB
    return {
        "rss_mb": kb(status["VmRSS"]),
        "anon_mb": kb(rollup["Anonymous"]),
        "fds": fds,
        "threads": int(status["Threads"]),
    }


def slope_per_1000(points: list[tuple[float, float]]) -> float:
    """The least-squares slope of ``(step, MB)`` points, in MB per 1000 steps (nan for fewer than 2 steps)."""
    if len({s for s, _ in points}) < 2:
        return math.nan
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_m = sum(m for _, m in points) / n
    cov = sum((s - mean_s) * (m - mean_m) for s, m in points)
    var = sum((s - mean_s) ** 2 for s, _ in points)
    return 1000 * cov / var


def run(args) -> tuple[int, dict[int, list[dict]]]:
    """Launches the run and samples it until it ends; returns the launcher's exit code and the samples by process."""
    from jddp import goodput

    per_epoch = TRAIN_EXAMPLES // GLOBAL_BATCH
    epochs = math.ceil(args.steps / per_epoch)
    samples: dict[int, list[dict]] = {}
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory() as run_dir, tempfile.TemporaryDirectory(prefix="soak-", dir=shm) as snaps:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)
        # The snapshots go to a directory of the soak's own (removed at its end), not the launcher's: a launcher in
        # another PID namespace sharing /dev/shm (a container, a sandboxed test) sees no process with this launcher's
        # pid and removes its jddp-snapshots-<pid>-* directory as a leftover; the run then goes on without snapshots.
        env.setdefault("JDDP_SNAPSHOT_DIR", snaps)
        if args.no_snapshots:
            env["JDDP_SNAPSHOTS"] = "0"
        if args.snapshot_every:
            env["JDDP_SNAPSHOT_EVERY"] = str(args.snapshot_every)
        argv = [
            sys.executable, "-m", "jddp.launch", "-n", "2",
            *(["--no-malloc-tuning"] if args.no_malloc_tuning else []),
            str(SCRIPT), f"config={CONFIG}", f"epochs={epochs}", "progress=false", f"save_every={args.save_every}",
            f"log_dir={run_dir}/log", f"checkpoint_dir={run_dir}/ckpt",
            *args.set,
        ]  # fmt: skip
        log = open(Path(run_dir) / "launch.log", "wb")  # read back on failure, after the run
        launcher = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        ledger = None
        start = time.time()
        try:
            while launcher.poll() is None:
                time.sleep(args.interval)
                if ledger is None:
                    ledger = next(iter(sorted((Path(run_dir) / "log" / goodput.LEDGER_DIR).glob("*/attempt-*"))), None)
                if ledger is None:
                    continue
                try:
                    step = int(goodput.read(ledger)["last_step"])
                except (OSError, ValueError, KeyError):
                    continue
                for rank, pid in enumerate(procs.workers(launcher.pid)):
                    found = sample(pid)
                    if found is not None:
                        samples.setdefault(rank, []).append({"t": time.time() - start, "step": step, **found})
        finally:
            if launcher.poll() is None:
                launcher.kill()
            launcher.wait()
            log.close()
        text = (Path(run_dir) / "launch.log").read_text(errors="replace")
        if launcher.returncode != 0:
            print(text[-3000:], file=sys.stderr)
        print("  " + next((line for line in reversed(text.splitlines()) if "fit: " in line), "(no fit line)").strip())
        # A snapshot write that failed (e.g. its directory removed under the run) is warned of once and the run goes
        # on without snapshots: the soak would then measure less than it says. Its warnings are shown.
        warned = dict.fromkeys(line.strip() for line in text.splitlines() if "Warning" in line or "warn" in line)
        for line in list(warned)[:5]:
            print("  " + line[:300])
    return launcher.returncode, samples


def report(args, samples: dict[int, list[dict]]) -> list[dict]:
    rows = []
    for rank, points in sorted(samples.items()):
        last_step = max(p["step"] for p in points)
        # The second half of the steps, without the samples at the last step: the run's end (the final evaluation,
        # the loss plot, closing) is not the steady state.
        late = [p for p in points if last_step / 2 <= p["step"] < last_step] or points
        rows.append(
            {
                "process": rank,
                "samples": len(points),
                "last_step": last_step,
                "rss_slope_mb_per_1000": slope_per_1000([(p["step"], p["rss_mb"]) for p in late]),
                "anon_slope_mb_per_1000": slope_per_1000([(p["step"], p["anon_mb"]) for p in late]),
                "rss_half_mb": late[0]["rss_mb"],
                "rss_end_mb": late[-1]["rss_mb"],
                "fds": (points[0]["fds"], points[-1]["fds"]),
                "threads": (points[0]["threads"], points[-1]["threads"]),
            }
        )
    for r in rows:
        print(
            f"  process {r['process']}: {r['samples']} samples to step {r['last_step']}; over steps >= "
            f"{r['last_step'] // 2}: RSS {r['rss_slope_mb_per_1000']:+.3f} MB per 1000 steps "
            f"({r['rss_half_mb']:.1f} -> {r['rss_end_mb']:.1f} MB), anonymous {r['anon_slope_mb_per_1000']:+.3f} MB "
            f"per 1000 steps; fds {r['fds'][0]} -> {r['fds'][1]}, threads {r['threads'][0]} -> {r['threads'][1]}"
        )
    return rows


QUICK: dict[str, Any] = {"steps": 200, "interval": 1.0}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=20000, help="at least this many steps (whole epochs)")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--no-snapshots", action="store_true", help="in-memory snapshots off (JDDP_SNAPSHOTS=0)")
    parser.add_argument("--snapshot-every", type=int, default=0, help="steps between snapshots (0: sized by cost)")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between samples")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="jddp launch's flag of the same name")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an override of the example")
    parser.add_argument("--out", default=None, help="also write the samples and the slopes here (JSON)")
    return parser


def bench(args: argparse.Namespace) -> Any:
    if args.steps < 2 or args.save_every < 1 or args.interval <= 0 or args.snapshot_every < 0:
        get_args_parser().error(f"--steps must be >= 2, --save-every >= 1 and --interval > 0, got {args}")
    load = os.getloadavg()
    snapshots = "off" if args.no_snapshots else f"every {args.snapshot_every or '(by cost)'}"
    print(
        f"soak: {args.steps} steps, a save every {args.save_every}, snapshots {snapshots}, "
        f"malloc tuning {'off' if args.no_malloc_tuning else 'on'}; load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        flush=True,
    )
    start = time.time()
    code, samples = run(args)
    load = os.getloadavg()
    print(f"  exit {code} after {time.time() - start:.0f} s; load at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    rows = report(args, samples) if samples else []
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "samples": samples}, indent=1))
    if code != 0 or not samples:
        sys.exit(code or 1)
    return {"rows": rows}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
