"""How does the MNIST-1D MLP's step time change over process x device topologies under ``jddp launch``?

Step time of the MNIST-1D MLP over process x device topologies, through ``jddp launch``.

For each topology (processes x simulated devices per process) the script runs
``jddp launch -n P --devices-per-process D`` on itself in worker mode. A worker
builds the MNIST-1D MLP (40-256-256-10, AdamW, global batch 128) and times,
step by step (each step waited for), on batches staged on the devices
beforehand:

* ``jddp``: ``DataParallel`` with its defaults (on CPU the all-reduce is one
  fused buffer per dtype, ``jddp.engine.fused``);
* ``jddp per-leaf``: the same with ``fuse_allreduce=False``, one all-reduce
  buffer per leaf (jddp before the fused buffer);
* ``hand-written pmean``: a ``jit(shard_map)`` step with a plain
  ``lax.pmean((loss, grads))`` and the optax update, what a JAX user writes;
* ``hand-written fused``: the same with loss and gradients concatenated into one
  vector before the ``pmean``;
* ``hand-written hier``: the fused vector reduced hierarchically on a
  ``("host", "local")`` view of the same devices: reduce-scatter inside each
  process, all-reduce of the quarter across processes, all-gather inside;
* ``jddp zero``: ``DataParallel(shard_optimizer=True)`` (ZeRO-1): gradients
  reduce-scattered, the optimizer state split, parameters all-gathered.

Variants alternate in blocks inside each worker (the order rotating), and
topologies alternate over rounds (the order reversed every other round), so
machine noise hits them alike. The table gives the median and 90th percentile
over every timed step, the ratio of medians to the same variant on 1x8, and to
``hand-written pmean`` in the same topology.

    python -m benchmarks multiprocess_step --topologies 1x8,2x1,2x2,2x4 --rounds 3
    python -m benchmarks multiprocess_step --topologies 2x4 --env XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
    python -m benchmarks multiprocess_step --topologies 2x1 --compare-cpu-share --variants jddp,hand-written pmean
    python -m benchmarks multiprocess_step --topologies 1x8,2x1,2x2 --variants "jddp,jddp zero"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

VARIANTS = ("jddp", "jddp per-leaf", "hand-written pmean", "hand-written fused", "hand-written hier", "jddp zero")
ROOT = Path(__file__).resolve().parents[1]

QUICK: dict[str, Any] = {
    "topologies": "2x1",
    "rounds": 1,
    "blocks": 1,
    "steps": 3,
    "variants": "jddp",
}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topologies", default="1x8,2x1,2x2,2x4", help="comma-separated PROCESSESxDEVICES")
    p.add_argument("--rounds", type=int, default=3, help="launches per topology")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks per variant in a launch")
    p.add_argument("--steps", type=int, default=10, help="timed steps per block")
    p.add_argument(
        "--hidden", type=int, default=256, help="MLP width (MNIST-1D's default 256; larger for bigger gradients)"
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ", ".join(VARIANTS))
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the workers (repeatable)")
    p.add_argument(
        "--compare-env",
        action="append",
        default=[],
        help="KEY=VALUE: also run every topology with this added (repeatable; all together), interleaved",
    )
    p.add_argument(
        "--compare-cpu-share",
        action="store_true",
        help="also run every topology with `jddp launch --cpu-share` (each process its cores), interleaved",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p


# ----------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    import jddp

    jddp.initialize(verbose=False)
    import itertools

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import lax
    from jax.sharding import AxisType, Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jddp import runtime
    from jddp.benchmark import models
    from jddp.engine import replicas

    variants = args.variants.split(",")
    sizes, batch_size, n_batches = [40, args.hidden, args.hidden, 10], 128, 8
    rng = np.random.default_rng(0)
    params = {f"l{i}": {"w": (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}
              for i, (a, b) in enumerate(itertools.pairwise(sizes))}  # fmt: skip
    optimizer = optax.adamw(3e-3, weight_decay=1e-4)
    mesh = jddp.data_mesh()

    def forward(params, x):
        for i in range(len(sizes) - 1):
            x = x @ params[f"l{i}"]["w"] + params[f"l{i}"]["b"]
            x = jax.nn.relu(x) if i < len(sizes) - 2 else x
        return x

    def loss_fn(params, model_state, batch, rng):
        losses = optax.softmax_cross_entropy_with_integer_labels(forward(params, batch["x"]), batch["y"])
        correct = (jnp.argmax(forward(params, batch["x"]), -1) == batch["y"]).astype(jnp.float32)
        mask = batch.get("mask")
        return jddp.masked_mean(losses, mask), (model_state, {"accuracy": jddp.masked_mean(correct, mask)})

    # Batches staged as global arrays: each process holds its rows.
    sharding = NamedSharding(mesh, P("data"))
    rows = batch_size // jax.process_count()
    lo = jax.process_index() * rows
    batches = []
    for _ in range(n_batches):
        x = rng.normal(size=(batch_size, 40)).astype(np.float32)
        y = rng.integers(0, 10, batch_size).astype(np.int32)
        batches.append({
            "x": jax.make_array_from_process_local_data(sharding, x[lo : lo + rows], x.shape),
            "y": jax.make_array_from_process_local_data(sharding, y[lo : lo + rows], y.shape),
        })  # fmt: skip

    # Hand-written steps: value_and_grad on varying params, pmean, optax update
    # ("hand-written pmean" is jddp.benchmark.models.reference_step).
    def mean_loss(p, batch):
        return optax.softmax_cross_entropy_with_integer_labels(forward(p, batch["x"]), batch["y"]).mean()

    local_n = jax.local_device_count()
    grid = Mesh(np.asarray(mesh.devices).reshape(-1, local_n), ("host", "local"), axis_types=(AxisType.Auto,) * 2)
    both = ("host", "local")

    def hierarchical_mean(flat):
        pad = -flat.size % local_n
        part = lax.psum_scatter(jnp.pad(flat, (0, pad)), "local", tiled=True)
        whole = lax.all_gather(lax.psum(part, "host"), "local", tiled=True, to="invarying")
        return whole[: flat.size] / (local_n * jax.process_count())

    def fused_step(fuse: str):
        # Standalone on purpose: the reference step's mean, but communicated differently,
        # which is what these variants measure: loss and gradients concatenated into one
        # vector before the pmean ("flat"), or that vector reduced hierarchically on a 2-D
        # ("host", "local") view of the devices ("hier"). The reference step's plain pmean
        # of the pytree over a 1-D mesh expresses neither.
        axes = both if fuse == "hier" else "data"

        def local(p, opt_state, batch):
            varying = jax.tree.map(lambda a: lax.pcast(a, axes, to="varying"), p)
            loss, grads = jax.value_and_grad(mean_loss)(varying, batch)
            leaves, treedef = jax.tree.flatten((loss, grads))
            flat = jnp.concatenate([jnp.ravel(a) for a in leaves])
            flat = hierarchical_mean(flat) if fuse == "hier" else lax.pmean(flat, "data")
            cuts = np.cumsum([a.size for a in leaves])[:-1]
            leaves = [f.reshape(a.shape) for f, a in zip(jnp.split(flat, cuts), leaves, strict=True)]
            loss, grads = jax.tree.unflatten(treedef, leaves)
            updates, opt_state = optimizer.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, loss

        m, spec = (grid, P(both)) if fuse == "hier" else (mesh, P("data"))
        mapped = jax.shard_map(local, mesh=m, in_specs=(P(), P(), spec), out_specs=(P(), P(), P()))
        return jax.jit(mapped, donate_argnums=(0, 1))

    def hand_step(fuse: str | None):
        step = models.reference_step(mean_loss, optimizer, mesh) if fuse is None else fused_step(fuse)
        rep = runtime.replicated(mesh)
        p = jax.tree.map(lambda a: replicas.put_replicated(a, rep), params)
        holder = [p, jax.jit(optimizer.init, out_shardings=rep)(p)]

        def run(batch):
            holder[0], holder[1], loss = step(holder[0], holder[1], batch)
            return loss

        return run

    def jddp_step(fuse: bool | None, shard: bool = False):
        dp = jddp.DataParallel(loss_fn, optimizer, mesh=mesh, fuse_allreduce=fuse, shard_optimizer=shard)
        holder = [dp.init(params, rng=0)]

        def run(batch):
            holder[0], _ = dp.step(holder[0], batch)
            return holder[0].params

        return run

    makers = {
        "jddp": lambda: jddp_step(None),
        "jddp per-leaf": lambda: jddp_step(False),
        "hand-written pmean": lambda: hand_step(None),
        "hand-written fused": lambda: hand_step("flat"),
        "hand-written hier": lambda: hand_step("hier"),
        "jddp zero": lambda: jddp_step(None, shard=True),
    }
    runs = {name: makers[name]() for name in variants}
    for run in runs.values():  # compile and warm up, one program at a time
        for b in batches[:3]:
            jax.block_until_ready(run(b))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for block in range(args.blocks):
        order = variants[block % len(variants) :] + variants[: block % len(variants)]
        for name in order:
            for i in range(args.steps):
                start = time.perf_counter()
                jax.block_until_ready(runs[name](batches[i % n_batches]))
                times[name].append((time.perf_counter() - start) * 1e3)
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(times), flush=True)


# ----------------------------------------------------------------- driver


def launch(topology: str, args: argparse.Namespace) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    env.update(kv.split("=", 1) for kv in args.env)
    flags = []
    if topology.endswith(" +env"):
        topology = topology.removesuffix(" +env")
        env.update(kv.split("=", 1) for kv in args.compare_env)
    if topology.endswith(" cpu-share"):
        topology = topology.removesuffix(" cpu-share")
        flags.append("--cpu-share")
    procs, devices = topology.split("x")
    cmd = [sys.executable, "-m", "jddp.launch", "-n", procs, "--devices-per-process", devices, *flags]
    cmd += [__file__, "--worker"]
    cmd += ["--blocks", str(args.blocks), "--steps", str(args.steps), "--variants", args.variants]
    cmd += ["--hidden", str(args.hidden)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"{topology} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def bench(args: argparse.Namespace) -> Any:
    if args.worker:
        worker(args)
        return {}
    import numpy as np

    topologies = args.topologies.split(",")
    if args.compare_env:
        topologies = [t + suffix for t in topologies for suffix in ("", " +env")]
    if args.compare_cpu_share:
        topologies = [t + suffix for t in topologies for suffix in ("", " cpu-share")]
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}.")
    times = {t: {v: [] for v in variants} for t in topologies}
    for r, t in harness.abba(topologies, args.rounds):
        started = time.perf_counter()
        for v, ms in launch(t, args).items():
            times[t][v].extend(ms)
        print(f"round {r + 1}/{args.rounds} {t}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    median = {t: {v: float(np.median(times[t][v])) for v in variants} for t in topologies}
    p90 = {t: {v: float(np.percentile(times[t][v], 90)) for v in variants} for t in topologies}
    base = topologies[0]
    ref = "hand-written pmean" if "hand-written pmean" in variants else variants[0]
    print(
        f"ms per step, {args.rounds} launches x {args.blocks} blocks x {args.steps} steps; env: {args.env or 'default'}"
    )
    print(f"{'topology':<13} {'variant':<19} {'median':>8} {'p90':>8} {f'/ {base}':>8} {'/ ' + ref:>21}")
    for t in topologies:
        for v in variants:
            print(f"{t:<13} {v:<19} {median[t][v]:8.2f} {p90[t][v]:8.2f} {median[t][v] / median[base][v]:8.2f} "
                  f"{median[t][v] / median[t][ref]:21.2f}")  # fmt: skip
    result = {"median_ms": median, "p90_ms": p90, "env": args.env, "compare_env": args.compare_env}
    return {**result, "times_ms": times}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
