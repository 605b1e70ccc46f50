"""The step-time cost of in-memory snapshots (``jddp.checkpoint.snapshot``), on and off, interleaved run by run.

    python -m benchmarks.snapshot_cost [--repeats 5] [--models mlp,lm] [--save-every 50]

Each run trains one example under ``jddp launch -n 2`` with a checkpoint directory (a disk save every
``--save-every`` steps, the same in both modes) and either ``JDDP_SNAPSHOTS=0`` (off) or snapshots on (their
default: every step unless their measured cost, above 1% of the step time, asks for fewer). The time per step is
process 0's goodput ledger's: from the end of the first step (compilation) to its last step, over the steps between,
everything included (data, logging, saves, evaluations: the same in both modes). Prints per model the median
per-step time of each mode, their ratio, the snapshots taken and their interval at the end, and the load average.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "mlp": [str(ROOT / "examples" / "mnist1d" / "train.py"), f"config={ROOT / 'configs' / 'mnist1d_mlp.yaml'}"],
    "lm": [str(ROOT / "examples" / "lm" / "train.py"), f"config={ROOT / 'configs' / 'lm.yaml'}"],
}
LENGTH = {"mlp": "epochs=8", "lm": "steps=120"}
SNAPSHOTS = re.compile(r"fit: .*; (\d+) in-memory snapshots, every (\d+) step")


def one_run(model: str, mode: str, args) -> dict | None:
    from jddp import goodput

    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("XLA_FLAGS", None)
        if mode == "off":
            env["JDDP_SNAPSHOTS"] = "0"
        else:
            env["JDDP_SNAPSHOT_DIR"] = str(Path(run_dir) / "memory")  # under jddp launch: its own, in /dev/shm
            env.pop("JDDP_SNAPSHOTS", None)
        argv = [
            sys.executable, "-m", "jddp.launch", "-n", "2", *MODELS[model], LENGTH[model], "progress=false",
            f"save_every={args.save_every}", f"log_dir={run_dir}/log", f"checkpoint_dir={run_dir}/ckpt",
        ]  # fmt: skip
        if mode == "on" and not os.path.isdir("/dev/shm"):
            print("  no /dev/shm: snapshots go to the temporary directory", flush=True)
        done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        if done.returncode != 0:
            print(f"  {model} {mode}: failed (exit {done.returncode})\n{done.stderr[-2000:]}", flush=True)
            return None
        ledger = goodput.read(next((Path(run_dir) / "log" / goodput.LEDGER_DIR).glob("*/attempt-0000.ledger")))
        per_step = (ledger["last_update"] - ledger["first_step_end"]) / max(ledger["steps_run"] - 1, 1)
        found = SNAPSHOTS.search(done.stdout)
        return {
            "step_ms": per_step * 1e3,
            "snapshots": int(found.group(1)) if found else 0,
            "every": int(found.group(2)) if found else 0,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="mlp,lm")
    parser.add_argument("--save-every", type=int, default=50)
    args = parser.parse_args()
    models = args.models.split(",")
    print(f"snapshot cost: {args.repeats} runs per mode and model, load {os.getloadavg()[0]:.2f}", flush=True)
    rows: dict[tuple[str, str], list[dict]] = {}
    for i in range(args.repeats):
        for model in models:
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                r = one_run(model, mode, args)
                if r is not None:
                    rows.setdefault((model, mode), []).append(r)
                    print(f"  {model} {mode}: {r}", flush=True)
    print(f"medians (load at the end {os.getloadavg()[0]:.2f}):")
    for model in models:
        off, on = rows.get((model, "off"), []), rows.get((model, "on"), [])
        if not off or not on:
            continue
        m_off = statistics.median(r["step_ms"] for r in off)
        m_on = statistics.median(r["step_ms"] for r in on)
        ratios = [b["step_ms"] / a["step_ms"] for a, b in zip(off, on, strict=False)]
        print(
            f"  {model}: off {m_off:.2f} ms/step, on {m_on:.2f} ms/step, on/off {m_on / m_off:.3f} (pairs: "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + f"); snapshots per run {statistics.median(r['snapshots'] for r in on):.0f}, interval at the end "
            + f"{statistics.median(r['every'] for r in on):.0f}"
        )


if __name__ == "__main__":
    main()
