"""Where does an in-memory snapshot's time go (``jddp.checkpoint.snapshot``), phase by phase, for the MLP and the LM?

    python -m benchmarks snapshot_profile [--models mlp,lm] [--snapshots 40] [--every 10]

Each model trains under ``jddp launch -n 2`` (the MLP with batches staged on the devices, the LM example with 8 of its
loader's batches staged, ``benchmarks/lm.py``; as ``benchmarks/snapshot_cost.py``'s workers), one ``Checkpointer``
with a snapshot every ``--every`` steps and no disk save. Process 0 (the one that keeps a replicated state's
snapshots) times each phase of its snapshots (``Snapshots.phases``): in the main thread (``take``) the wait for the
previous write, the state's signature and layout, the choice of the local shards, the copy program's dispatch and the
header; in the writer thread (``_write``) the wait for the copy, the CRC-32, the header's JSON, the write and the
renames. Prints per phase the median wall time and thread time (ms) of ``--snapshots`` snapshots taken in the training
loop (steps in flight: the cores shared with the step and the other process), then of as many taken with the devices
idle (the loop's last state, nothing in flight); per snapshot the main thread's phases summed (wall time) and the
writer's (thread time); and the median and mean of each snapshot's own measure of its cost (the main thread's wall
time, the wait for the previous write included, plus the writer's thread time: what sizes the snapshot interval; its
mean shows the snapshots whose main thread lost its core), with the state's leaves and bytes, and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
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


def worker(args) -> None:
    import jax
    import optax

    import jddp
    from benchmarks import lm
    from jddp.benchmark import models
    from jddp.checkpoint.restore import as_dict

    jddp.initialize(verbose=False)
    mesh = jddp.data_mesh()
    if args.model == "lm":
        dp, state, batches = lm.setup(mesh)
    else:  # as benchmarks/snapshot_cost.py's worker

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
    ckpt = jddp.Checkpointer(args.dir, snapshots=True, snapshot_every=args.every)
    snaps = ckpt._snapshots  # the one private handle: its phases and its cost measure
    assert snaps is not None
    costs: list[float] = []
    measured = snaps._measured

    def record(seconds: float) -> None:
        costs.append(seconds)
        measured(seconds)

    snaps._measured = record
    step = 0

    def steps(n: int) -> None:
        nonlocal state, step
        for _ in range(n):
            state, _ = dp.step(state, batches[step % len(batches)])
            ckpt.maybe_save(state)
            step += 1

    steps(3 * args.every)  # warm-up: compilation, the first snapshot's copy program
    snaps.wait()
    snaps.phases, costs[:] = {}, []
    steps(args.snapshots * args.every)
    snaps.wait()
    in_loop, loop_costs = snaps.phases, list(costs)
    jax.block_until_ready(state)
    snaps.phases, costs[:] = {}, []
    tree = as_dict(state)
    for i in range(args.snapshots):
        snaps.take(step + 1 + i, tree, None, None)
        snaps.wait()
    alone, alone_costs = snaps.phases, list(costs)
    ckpt.close()
    if jax.process_index() == 0:
        leaves = jax.tree.leaves(tree)
        print(
            "RESULT "
            + json.dumps(
                {
                    "leaves": len(leaves),
                    "bytes": sum(int(x.nbytes) for x in leaves),
                    "loop": {"phases": in_loop, "costs": loop_costs},
                    "alone": {"phases": alone, "costs": alone_costs},
                }
            ),
            flush=True,
        )


def run(model: str, args) -> dict | None:
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "JDDP_SNAPSHOT_DIR": str(Path(run_dir) / "memory")}
        env.pop("XLA_FLAGS", None)
        argv = [
            sys.executable, "-m", "jddp.launch", "-n", "2", __file__, "--worker", "--dir", f"{run_dir}/ckpt",
            "--model", model, "--snapshots", str(args.snapshots), "--every", str(args.every),
        ]  # fmt: skip
        done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    found = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode != 0 or not found:
        print(f"  {model}: failed (exit {done.returncode})\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}", flush=True)
        return None
    return json.loads(found[0])


MAIN = ("signature", "shards", "dispatch", "header")  # the main thread's phases after the join (Snapshots.take)


def medians(phases: dict[str, list[list[float]]]) -> dict[str, tuple[float, float]]:
    """Per phase, the median wall and thread time in ms; and per snapshot, the main thread's phases summed (its
    wall time, as the cost measure counts it) and the writer's (its thread time, likewise)."""
    out = {
        name: (statistics.median(w for w, _ in times) * 1e3, statistics.median(c for _, c in times) * 1e3)
        for name, times in phases.items()
    }
    main = [sum(row) for row in zip(*([w for w, _ in phases.get(n, [])] for n in MAIN), strict=True)]
    writer = [
        sum(row)
        for row in zip(*([c for _, c in t] for n, t in phases.items() if n not in (*MAIN, "join")), strict=True)
    ]
    out["main thread, summed"] = (statistics.median(main) * 1e3, float("nan"))
    out["writer, summed"] = (float("nan"), statistics.median(writer) * 1e3)
    return out


QUICK: dict[str, Any] = {"models": "mlp", "snapshots": 3, "every": 2}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--models", default="mlp,lm")
    parser.add_argument("--snapshots", type=int, default=40, help="snapshots timed, in the loop and then alone")
    # fewer steps apart, a snapshot waits for the previous one's write: its copy runs after the steps in flight
    parser.add_argument("--every", type=int, default=10, help="steps between snapshots in the loop")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("mlp", "lm"), default="mlp", help=argparse.SUPPRESS)
    return parser


def bench(args: argparse.Namespace) -> Any:
    if args.worker:
        worker(args)
        return
    models = args.models.split(",")
    start = time.strftime("%H:%M", time.gmtime())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results = {m: r for m in models if (r := run(m, args)) is not None}
    if not results:
        sys.exit(1)
    print(
        f"snapshot phases under jddp launch -n 2, process 0, {args.snapshots} snapshots per model and setting "
        f"({start} to {time.strftime('%H:%M', time.gmtime())} UTC, load {load} at the start, "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end); median ms, wall / thread time"
    )
    heads = [f"{m}: {r['leaves']} leaves, {r['bytes'] / 1e6:.2f} MB" for m, r in results.items()]
    print("    " + " " * 20 + "".join(f"{h:>36}" for h in heads))
    for setting, title in (("loop", f"in the loop (a snapshot every {args.every} steps)"), ("alone", "alone")):
        print(f"  {title}")
        table = {m: medians(r[setting]["phases"]) for m, r in results.items()}
        names = list(dict.fromkeys(n for t in table.values() for n in t))
        for name in names:
            cells = "".join(
                f"{f'{t[name][0]:.3f} / {t[name][1]:.3f}' if name in t else '-':>36}" for t in table.values()
            )
            print(f"    {name:<20}{cells}")
        costs = "".join(f"{statistics.median(r[setting]['costs']) * 1e3:>36.3f}" for r in results.values())
        print(f"    {'cost measure':<20}{costs}")
        means = "".join(f"{statistics.mean(r[setting]['costs']) * 1e3:>36.3f}" for r in results.values())
        print(f"    {'  its mean':<20}{means}")
    return results


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
