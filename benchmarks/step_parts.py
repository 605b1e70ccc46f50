"""Where does a data-parallel step's time go at 2 processes: the computation, the all-reduce, jddp's steps?

Where a data-parallel step's time goes at 2 processes: the computation alone, the all-reduce alone, jddp's steps.

    python -m benchmarks step_parts [--model mlp784] [--rounds 5] [--steps 10]

Starts 2 processes under ``jddp launch --transport mpi`` (the ``jddp[mpi]``
extra) and times, interleaved round by round, on the same batches:

* ``compute only``: the hand-written step without its all-reduce
  (``models.reference_step(reduce=False)``: gradients, optimizer update);
* ``jddp xla`` and ``jddp mpi``: ``DataParallel.step`` with each transport
  (``nonfinite="ignore"``, as PyTorch DDP has no guard);
* ``mpi sum``: ``mpi_psum`` of one buffer of the model's gradient size.

Prints each median in ms. ``--model mlp784`` (784-1024-1024-10, SGD with
momentum) is the model of BENCHMARKS.md section 12, where this breakdown says
why the MPI transport's gain is bounded there.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

VARIANTS = ("compute only", "jddp xla", "jddp mpi", "mpi sum")

QUICK: dict[str, Any] = {"model": "mlp", "rounds": 1, "steps": 2}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mlp784", help="a model of jddp.benchmark.models (default mlp784)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=10, help="steps per variant and round (default 10)")
    return p


def bench(args: argparse.Namespace) -> Any:
    cmd = [sys.executable, "-m", "jddp.launch", "--transport", "mpi", "-n", "2", "-m", "benchmarks.step_parts"]
    cmd += ["--worker", args.model, str(args.rounds), str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the group failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print("\n".join(line[4:] for line in proc.stdout.splitlines() if line.startswith("[0] PART")))


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


def _worker(model: str, rounds: str, steps: str) -> None:
    import jddp

    jddp.initialize(verbose=False)
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jddp.benchmark import models
    from jddp.engine import mpi

    params = models.init_params(model)
    optimizer = optax.sgd(0.01, momentum=0.9) if model == models.WIDE else optax.adamw(1e-3, weight_decay=1e-4)
    mean_loss = functools.partial(models.mean_loss, model)
    loss_fn = lambda p, s, b, r: (mean_loss(p, b), (s, {}))
    rank, n = jax.process_index(), jax.process_count()
    rows = 256 // n
    host = models.synthetic_batches(1, 256, width=models.features(model))[0]
    sharding = jddp.batch_sharding(jddp.data_mesh())
    batch = {k: jax.make_array_from_process_local_data(sharding, v[rank * rows : (rank + 1) * rows], v.shape)
             for k, v in host.items()}  # fmt: skip
    mesh = Mesh(jax.devices(), ("batch",))
    rep = NamedSharding(mesh, P())
    local = models.reference_step(mean_loss, optimizer, mesh, reduce=False)
    placed = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, rep, lambda i: a[i]), params)
    carry = {"local": (placed, jax.jit(optimizer.init, out_shardings=rep)(placed))}
    dps = {t: jddp.DataParallel(loss_fn, optimizer, mesh=jddp.data_mesh(), transport=t, nonfinite="ignore")
           for t in ("xla", "mpi")}  # fmt: skip
    states = {t: dp.init(params) for t, dp in dps.items()}
    size = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    flat = jax.make_array_from_process_local_data(sharding, np.ones((1, size), np.float32), (n, size))
    body = lambda x: mpi.mpi_psum(x, jddp.DATA_AXIS)
    summed = jax.jit(jax.shard_map(body, mesh=jddp.data_mesh(), in_specs=P(jddp.DATA_AXIS), out_specs=P()))

    def compute_only():
        p, o, loss = local(*carry["local"], batch)
        carry["local"] = (p, o)
        return loss

    def step(transport: str):
        def run():
            states[transport], metrics = dps[transport].step(states[transport], batch)
            return metrics["loss"]

        return run

    calls = {"compute only": compute_only, "jddp xla": step("xla"), "jddp mpi": step("mpi"),
             "mpi sum": lambda: summed(flat)}  # fmt: skip
    for call in calls.values():  # compile, warm up
        for _ in range(3):
            jax.block_until_ready(call())
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(int(rounds)):
        for name in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            start = time.perf_counter()
            for _ in range(int(steps)):
                jax.block_until_ready(calls[name]())
            times[name].append((time.perf_counter() - start) * 1e3 / int(steps))
    if rank == 0:
        print(f"PART {model} at 2 processes, {size * 4 / 1e6:.1f} MB of gradients; median ms of {rounds} rounds")
        for name, t in times.items():
            print(f"PART {name:<14}{statistics.median(t):8.2f} ms  [{min(t):.2f}, {max(t):.2f}]")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(*sys.argv[2:])
    else:
        main()
