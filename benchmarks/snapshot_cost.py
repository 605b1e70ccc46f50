"""What do in-memory snapshots (``jddp.checkpoint.snapshot``) cost per step, on against off, interleaved?

The step-time cost of in-memory snapshots (``jddp.checkpoint.snapshot``), on and off, interleaved run by run.

    python -m benchmarks snapshot_cost [--repeats 5] [--models mlp,lm] [--save-every 50]

Each run trains one example under ``jddp launch -n 2`` with a checkpoint directory (a disk save every
``--save-every`` steps, the same in both modes) and either ``JDDP_SNAPSHOTS=0`` (off) or snapshots on (their
default: every step unless their measured cost, above 1% of the step time, asks for fewer). The time per step is
process 0's goodput ledger's: from the end of the first step (compilation) to its last step, over the steps between,
everything included (data, logging, saves, evaluations: the same in both modes). Prints per model the median
per-step time of each mode, their ratio, the snapshots taken and their interval at the end, the median of the
pairs' ratios (run i of each mode is a pair, run side by side) with a 95% bootstrap interval, and the load average.

    python -m benchmarks snapshot_cost --within [--repeats 3] [--blocks 20] [--block 200] [--snapshot-every 0]
                                       [--budget 0] [--after 0]

The runs of a pair differ by more than the cost on a shared machine (whole runs of the MLP spread by 10%). With
``--within`` the comparison is made inside each run instead, block by block (``worker``): the MLP under
``jddp launch -n 2`` with one ``Checkpointer`` (snapshots on, a disk save every ``--save-every`` steps), blocks of
``--block`` steps alternating between snapshots taken and not, each pair of blocks a few seconds apart. Prints per
run the medians of each mode, the snapshots taken, their interval at the end and their own two measures of their
cost (the threads' time, and the wall time they add to the ``AFTER`` steps after them), beside the cost per
snapshot the blocks show (the median extra time of an on block over its off block, over the snapshots taken in on
blocks), then over every block pair the median on/off ratio and the ratio of the on blocks' total time to the
off blocks' (what a run pays), each with its 95% bootstrap interval. ``--budget`` sets ``snapshot_budget``,
``--after`` ``jddp.checkpoint.snapshot_interval.AFTER``, to compare settings. ``--out FILE`` adds the run's block
pairs to a JSON file; ``--pooled FILE`` prints the two statistics over every pair saved there, runs pooled.

    python -m benchmarks snapshot_cost --within --compare kept [...]

The same blocks, but what the off blocks leave out is only the copy of every step kept for the survivors of a failure
(``jddp.checkpoint.snapshot_kept``): the snapshots are taken in both, so the ratio is the kept steps' own cost.
"""

from __future__ import annotations

import argparse
import json
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

from benchmarks import harness

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


# ----------------------------------------------------------------- --within: on and off in one run, block by block


def worker(args) -> None:
    """Under ``jddp launch -n 2``: the MNIST-1D MLP (40-256-256-10, AdamW, global batch 128, batches staged on the
    devices: no loader, so the step is as short as it gets and the snapshots' share as large), ``DataParallel`` and
    a ``Checkpointer`` with snapshots on, ``maybe_save`` every step; blocks of ``--block`` steps alternate (ABBA)
    between snapshots on and off. Off, the snapshot's ``take`` does nothing (the interval is still proposed and
    agreed, the disk saves are the same); an on block ends once its last snapshot is written. ``--model lm``: the
    LM example's model and optimizer instead (``benchmarks/lm.py``), batches from its loader."""
    import jax
    import optax

    import jddp
    from jddp.benchmark import models

    jddp.initialize(verbose=False)
    mesh = jddp.data_mesh()
    if args.model == "lm":
        from benchmarks import lm

        dp, state, batches = lm.setup(mesh)
    else:

        def loss_fn(params, model_state, batch, rng):
            return models.mean_loss("mlp", params, batch), (model_state, {})

        dp = jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=mesh)
        state = dp.init(models.init_params("mlp"), rng=0)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        rows = 128 // jax.process_count()
        mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
        batches = [
            {k: jax.make_array_from_process_local_data(sharding, v[mine], v.shape) for k, v in b.items()}
            for b in models.synthetic_batches(8, 128)
        ]
    every = args.snapshot_every or None
    budget = {"snapshot_budget": args.budget} if args.budget else {}  # else the Checkpointer's default
    if args.after:
        from jddp.checkpoint import snapshot_interval

        snapshot_interval.AFTER = args.after  # read there, by the interval's cost model
    ckpt = jddp.Checkpointer(args.dir, save_every=args.save_every, snapshots=True, snapshot_every=every, **budget)
    snaps = ckpt._snapshots  # the one private handle: the same Checkpointer, its snapshots taken or not
    assert snaps is not None
    step = 0

    taken_on = 0  # snapshots taken in the measured on blocks

    def block(mode: str) -> float:
        nonlocal state, step, taken_on
        depth = snaps.kept.depth  # decided at the first step's take: the warm-up blocks are "on"
        if mode == "off" and args.compare == "kept":
            snaps.kept.depth = 0  # `keeps` is False: only the snapshot steps call `take`
        elif mode == "off":
            snaps.take = lambda *a, **k: None
        taken = snaps.taken
        start = time.perf_counter()
        for _ in range(args.block):
            state, _ = dp.step(state, batches[step % len(batches)])
            ckpt.maybe_save(state)
            step += 1
        jax.block_until_ready(state)
        snaps.wait()
        seconds = time.perf_counter() - start
        vars(snaps).pop("take", None)
        if mode == "off":
            snaps.kept.depth = depth
        taken_on += snaps.taken - taken
        return seconds / args.block

    for _ in range(2):  # warm-up: compilation, the first snapshot's copy program, the interval settling
        block("on")
    taken_on = 0
    times: dict[str, list[float]] = {"on": [], "off": []}
    for _, mode in harness.abba(("on", "off"), args.blocks):
        times[mode].append(block(mode) * 1e3)
    ckpt.close()
    if jax.process_index() == 0:
        # the snapshots' own measure of their cost (what sizes the interval), for comparison with the blocks'
        summary = {
            "kept_depth": snaps.kept.depth,
            "snapshots": snaps.taken,
            "every": ckpt.snapshot_every,
            "cost_ms": (snaps._cost_s or 0) * 1e3,
            "wall_cost_ms": (snaps._wall_cost_s or 0) * 1e3,
            "taken_on": taken_on,
        }
        print("RESULT " + json.dumps({"times_ms": times, **summary}), flush=True)


def block_cost(on: list[float], off: list[float], result: dict, args) -> float:
    """Each snapshot's cost (ms of wall time) as the blocks show it: the on blocks' time over the off blocks'
    (median per pair), spread over the snapshots taken in them."""
    extra = statistics.median(a - b for a, b in zip(on, off, strict=True)) * args.block * len(on)
    return extra / max(result["taken_on"], 1)


def within(args) -> dict:
    """Runs ``worker`` under ``jddp launch -n 2`` ``--repeats`` times and prints on/off per block pair."""
    ratios, on_ms, off_ms = [], [], []
    print(f"snapshot cost within runs ({args.model}): {args.repeats} runs x {args.blocks} block pairs x "
          f"{args.block} steps, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)  # fmt: skip
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as run_dir:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "JDDP_SNAPSHOT_DIR": str(Path(run_dir) / "memory")}
            env.pop("XLA_FLAGS", None)
            argv = [
                sys.executable, "-m", "jddp.launch", "-n", "2", __file__, "--worker", "--dir", f"{run_dir}/ckpt",
                "--blocks", str(args.blocks), "--block", str(args.block), "--save-every", str(args.save_every),
                "--snapshot-every", str(args.snapshot_every), "--budget", str(args.budget),
                "--after", str(args.after), "--model", args.model, "--compare", args.compare,
            ]  # fmt: skip
            done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
        found = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT " in line]
        if done.returncode != 0 or not found:
            print(f"  run {r}: failed (exit {done.returncode})\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            continue
        result = json.loads(found[0])
        on, off = result["times_ms"]["on"], result["times_ms"]["off"]
        ratios += [a / b for a, b in zip(on, off, strict=True)]
        on_ms += on
        off_ms += off
        print(
            f"  run {r} ({args.compare}, kept {result['kept_depth']} deep): on {statistics.median(on):.3f} ms/step, "
            f"off {statistics.median(off):.3f}, "
            f"{result['snapshots']} snapshots, every {result['every']} step(s) at the end, each "
            f"{result['cost_ms']:.2f} ms by its threads' time, {result['wall_cost_ms']:.2f} ms by the wall time of the "
            f"steps after it; by the blocks: {block_cost(on, off, result, args):.2f} ms each",
            flush=True,
        )
    if not ratios:
        sys.exit(1)
    if args.out:
        pairs = [{"on_ms": a, "off_ms": b} for a, b in zip(on_ms, off_ms, strict=True)]
        saved = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {"runs": []}
        saved["runs"].append({"model": args.model, "block": args.block, "load_end": os.getloadavg()[0], "pairs": pairs})
        Path(args.out).write_text(json.dumps(saved, indent=1) + "\n")
    return report(on_ms, off_ms)


def report(on_ms: list[float], off_ms: list[float]) -> dict:
    """Two statistics of the block pairs: the median of the on/off ratios (robust to a block hit by something else)
    and the ratio of the on blocks' total time to the off blocks' (what a run pays: its wall time), each with a 95%
    bootstrap interval over the pairs."""
    ratios = [a / b for a, b in zip(on_ms, off_ms, strict=True)]
    low, high = harness.bootstrap_median(ratios)
    total = sum(on_ms) / sum(off_ms)
    t_low, t_high = harness.bootstrap_total(on_ms, off_ms)
    print(
        f"over {len(ratios)} block pairs (load at the end {os.getloadavg()[0]:.2f}): on "
        f"{statistics.median(on_ms):.3f} ms/step, off {statistics.median(off_ms):.3f} ms/step (medians); on/off per "
        f"pair: median {statistics.median(ratios):.4f}, 95% bootstrap interval {low:.4f} to {high:.4f}; total time "
        f"on/off {total:.4f}, 95% bootstrap interval {t_low:.4f} to {t_high:.4f}"
    )
    return {"pair_ratios": ratios, "median_pair_ratio": statistics.median(ratios), "ci95": [low, high],
            "total_ratio": total, "total_ci95": [t_low, t_high]}  # fmt: skip


QUICK: dict[str, Any] = {"repeats": 1, "models": "mlp", "blocks": 2, "block": 10}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", default="mlp,lm")
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--within", action="store_true", help="on and off in blocks inside each run")
    parser.add_argument("--blocks", type=int, default=20, help="--within: block pairs per run")
    parser.add_argument("--block", type=int, default=200, help="--within: steps per block")
    parser.add_argument("--snapshot-every", type=int, default=0, help="--within: fixed interval (0: by their cost)")
    parser.add_argument("--budget", type=float, default=0.0, help="--within: snapshot_budget (0: the default)")
    parser.add_argument("--after", type=int, default=0, help="--within: snapshot_interval.AFTER (0: jddp's)")
    parser.add_argument("--model", choices=("mlp", "lm"), default="mlp", help="--within: the model")
    parser.add_argument("--out", default=None, help="--within: a JSON file the block pairs are added to")
    parser.add_argument(
        "--compare", choices=("snapshots", "kept"), default="snapshots", help="--within: what the off blocks leave out"
    )
    parser.add_argument("--pooled", default=None, help="print the statistics of the pairs saved in this file, pooled")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    return parser


def bench(args: argparse.Namespace) -> Any:
    if args.worker:
        worker(args)
        return None
    if args.pooled:
        runs = json.loads(Path(args.pooled).read_text())["runs"]
        pairs = [pair for run in runs for pair in run["pairs"]]
        print(f"{args.pooled}: {len(runs)} runs ({', '.join(sorted({r['model'] for r in runs}))})")
        return report([p["on_ms"] for p in pairs], [p["off_ms"] for p in pairs])
    if args.within:
        return within(args)
    models = args.models.split(",")
    print(f"snapshot cost: {args.repeats} runs per mode and model, load {os.getloadavg()[0]:.2f}", flush=True)
    rows: dict[tuple[str, str], list[dict]] = {}
    for i in range(args.repeats):
        for model in models:
            for mode in harness.ab_order(("off", "on"), i):
                r = one_run(model, mode, args)
                if r is not None:
                    rows.setdefault((model, mode), []).append(r)
                    print(f"  {model} {mode}: {r}", flush=True)
    print(f"medians (load at the end {os.getloadavg()[0]:.2f}):")
    results = {}
    for model in models:
        off, on = rows.get((model, "off"), []), rows.get((model, "on"), [])
        if not off or not on:
            continue
        m_off = statistics.median(r["step_ms"] for r in off)
        m_on = statistics.median(r["step_ms"] for r in on)
        ratios = [b["step_ms"] / a["step_ms"] for a, b in zip(off, on, strict=False)]
        low, high = harness.bootstrap_median(ratios)
        results[model] = {"off": off, "on": on, "pair_ratios": ratios, "ci95": [low, high]}
        print(
            f"  {model}: off {m_off:.2f} ms/step, on {m_on:.2f} ms/step, on/off {m_on / m_off:.3f} (pairs: "
            + ", ".join(f"{x:.3f}" for x in ratios)
            + f"); snapshots per run {statistics.median(r['snapshots'] for r in on):.0f}, interval at the end "
            + f"{statistics.median(r['every'] for r in on):.0f}; median of the {len(ratios)} pairs' ratios "
            + f"{statistics.median(ratios):.3f}, 95% bootstrap interval {low:.3f} to {high:.3f}"
        )
    return results


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
