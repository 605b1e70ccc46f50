"""How do the control plane's costs grow with the process count (1 device per process, a tiny model)?

How the control plane's costs grow with the process count (1 device per process, a tiny model).

    python -m benchmarks process_count [--counts 2,4,8,16] [--steps 30]

For each N, ``jddp launch -n N`` runs this file in worker mode. Every process times, on the same schedule:

* ``join``: from the attempt's start (the launcher's) to ``jddp.initialize`` returning;
* ``first step``: from there to the first step's result (model init, compile, one all-reduce);
* ``step``: the median step afterwards (an MLP of 16x32x4: the step is nearly all all-reduce and dispatch);
* ``barrier``, ``all_gather`` (``host_all_gather`` of a small dict, the agreement ``maybe_save`` and the loader
  use) and ``heartbeat`` (one watchdog round: ``key_value_set`` of this process's value and ``key_value_dir_get``
  of everyone's): medians of 20;
* ``save`` and ``restore``: a synchronous checkpoint of the state and its restore (``Checkpointer``).

Process 0's figures are printed; on 2 cores every process beyond 2 also competes for the CPU, so the figures
mix the control plane's growth with CPU sharing. The table gives each figure against N, and the slope of its
log against log N (1: linear, 2: quadratic).
"""

from __future__ import annotations

import argparse
import json
import math
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
KEYS = ("join_s", "first_step_s", "step_ms", "barrier_ms", "all_gather_ms", "heartbeat_ms", "save_s", "restore_s")


def worker(args: argparse.Namespace) -> None:
    start = float(os.environ.get("JDDP_ATTEMPT_START", time.time()))
    import jddp

    jddp.initialize()
    joined = time.time()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jddp.runtime import jax_internals, watchdog

    def loss_fn(params, model_state, batch, key):
        logits = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
        loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
        return loss, (model_state, {})

    n = jax.process_count()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * n * (args.steps + 2), 16)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    params = {"w1": rng.normal(size=(16, 32)).astype(np.float32), "w2": rng.normal(size=(32, 4)).astype(np.float32)}
    dp = jddp.DataParallel(loss_fn, optax.sgd(0.01), mesh=jddp.data_mesh())
    state = dp.init(params, rng=0)
    loader = jddp.data.DataLoader({"x": x, "y": y}, global_batch_size=4 * n, seed=0)
    batches = iter(loader)
    state, metrics = dp.step(state, next(batches))
    float(metrics["loss"])
    first = time.time()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        state, metrics = dp.step(state, next(batches))
        float(metrics["loss"])
        times.append(time.perf_counter() - t)

    def median_ms(fn, repeats: int = 20) -> float:
        out = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return 1e3 * statistics.median(out)

    counter = iter(range(10**6))
    barrier_ms = median_ms(lambda: jddp.barrier(f"bench-{next(counter)}"))
    gather_ms = median_ms(lambda: jddp.host_all_gather({"step": 1, "preempted": False}))
    client = jax_internals.distributed_client()
    key = f"bench/alive/{jax.process_index()}"
    heartbeat_ms = median_ms(
        lambda: (
            client.key_value_set(key, "1;2;3;0;4.0;1;step;0.0", allow_overwrite=True),
            client.key_value_dir_get(watchdog.ALIVE_PREFIX),
        )
    )
    ckpt_dir = os.environ["BENCH_CKPT"]
    ckpt = jddp.Checkpointer(ckpt_dir, async_save=False)
    t = time.perf_counter()
    ckpt.save(state, wait=True)
    save_s = time.perf_counter() - t
    ckpt.close()
    ckpt = jddp.Checkpointer(ckpt_dir, async_save=False)
    fresh = dp.init(params, rng=0)
    t = time.perf_counter()
    ckpt.restore_or_init(fresh)
    restore_s = time.perf_counter() - t
    ckpt.close()
    result = {
        "join_s": joined - start,
        "first_step_s": first - joined,
        "step_ms": 1e3 * statistics.median(times),
        "barrier_ms": barrier_ms,
        "all_gather_ms": gather_ms,
        "heartbeat_ms": heartbeat_ms,
        "save_s": save_s,
        "restore_s": restore_s,
    }
    if jax.process_index() == 0:
        print("RESULT " + json.dumps(result), flush=True)


def run(n: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as d:
        env["BENCH_CKPT"] = os.path.join(d, "ckpt")
        cmd = [sys.executable, "-m", "jddp.launch", "-n", str(n), "--devices-per-process", "1", "--peer-timeout", "120"]
        cmd += [__file__, "--worker", "--steps", str(steps)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])
    raise RuntimeError(f"N={n} failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


QUICK: dict[str, Any] = {"counts": "2", "steps": 5}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="2,4,8,16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def bench(args: argparse.Namespace) -> Any:
    if args.worker:
        worker(args)
        return
    counts = [int(c) for c in args.counts.split(",")]
    load = os.getloadavg()[0]
    print(f"process count benchmark: N = {counts}, 1 device each, {os.cpu_count()} cores, load {load:.2f}")
    rows = {}
    for n in counts:
        rows[n] = run(n, args.steps)
        print(f"  N={n}: " + ", ".join(f"{k} {v:.3g}" for k, v in rows[n].items()), flush=True)
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    print(f"{'N':>4}" + "".join(f"{k:>15}" for k in KEYS))
    for n, r in rows.items():
        print(f"{n:>4}" + "".join(f"{r[k]:>15.3g}" for k in KEYS))
    if len(counts) >= 2:
        lo, hi = counts[0], counts[-1]
        slopes = {k: math.log(rows[hi][k] / rows[lo][k]) / math.log(hi / lo) for k in KEYS if rows[lo][k] > 0}
        shown = ", ".join(f"{k} {v:.2f}" for k, v in slopes.items())
        print(f"slope of log(cost) over log(N), N={lo} to {hi}: {shown}")
    return {"rows": rows}


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


if __name__ == "__main__":
    main()
