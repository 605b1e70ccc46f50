"""How long to the first training step at 2 processes: jddp with a cold and a warm compilation cache, and PyTorch DDP?

Time to the first training step at 2 processes: jddp with a cold and a warm compilation cache, and PyTorch DDP.

    python -m benchmarks first_step [--repeats 5]

Each mode starts a fresh 2-process group from the shell's point of view and
times it from just before the launcher starts to the end of the first step on
process 0 (wall clock, ``time.time()`` printed by the worker): Python's start,
the imports, joining the group, building the model and optimizer, and the first
step with its compilation. The model is the MNIST-1D MLP of ``jddp bench``
(40-256-256-10, AdamW), global batch 256, synthetic data:

* ``jddp cold``: ``jddp launch -n 2`` with ``JDDP_COMPILATION_CACHE=0``;
* ``jddp warm``: the same with a cache directory that one run filled first;
* ``torch``: ``torchrun --nproc-per-node 2`` (gloo, 1 thread per process), the
  same model in ``DistributedDataParallel`` (PyTorch compiles nothing).

Modes run interleaved, ``--repeats`` times each; prints the medians, the
min-max range and the load average. Needs the ``bench`` extra (PyTorch).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness

MODES = ("jddp cold", "jddp warm", "torch")

QUICK: dict[str, Any] = {"repeats": 1}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs per mode, interleaved (default 5)")
    return p


def _run(mode: str, cache: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JDDP_")}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    if mode == "torch":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd += ["-m", "benchmarks.first_step", "--torch-worker"]
        env["OMP_NUM_THREADS"] = "1"
    else:
        env["JDDP_COMPILATION_CACHE"] = "0" if mode == "jddp cold" else cache
        cmd = [sys.executable, "-m", "jddp.launch", "-n", "2", "-m", "benchmarks.first_step", "--jddp-worker"]
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    first = [line for line in proc.stdout.splitlines() if "FIRST STEP" in line]
    if not first:
        raise RuntimeError(f"{mode}: no FIRST STEP line:\n{proc.stdout[-3000:]}")
    return float(first[0].split()[-1]) - start


def bench(args: argparse.Namespace) -> Any:
    times: dict[str, list[float]] = {m: [] for m in MODES}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as cache:
        _run("jddp warm", cache)  # fills the cache
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                times[mode].append(_run(mode, cache))
    load_after = os.getloadavg()
    print(f"time from launch to the end of the first step, 2 processes, MNIST-1D MLP; {args.repeats} runs per mode")
    print(f"{'mode':<12}{'median s':>10}{'min':>8}{'max':>8}{'/ torch':>9}")
    torch_median = statistics.median(times["torch"])
    for mode, t in times.items():
        med = statistics.median(t)
        print(f"{mode:<12}{med:>10.2f}{min(t):>8.2f}{max(t):>8.2f}{med / torch_median:>9.2f}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    return times


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


def _jddp_worker() -> None:
    import jddp

    jddp.initialize(verbose=False)
    import functools

    import jax
    import optax

    from jddp.benchmark import models

    loss = functools.partial(models.mean_loss, "mlp")
    dp = jddp.DataParallel(lambda p, s, b, r: (loss(p, b), (s, {})), optax.adamw(1e-3), mesh=jddp.data_mesh())
    state = dp.init(models.init_params("mlp"))
    rank, rows = jax.process_index(), 256 // jax.process_count()
    host = models.synthetic_batches(1, 256)[0]
    sharding = jddp.batch_sharding(dp.mesh)
    batch = {k: jax.make_array_from_process_local_data(sharding, v[rank * rows : (rank + 1) * rows], v.shape)
             for k, v in host.items()}  # fmt: skip
    state, metrics = dp.step(state, batch)
    float(metrics["loss"])
    if rank == 0:
        print(f"FIRST STEP {time.time():.6f}", flush=True)


def _torch_worker() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.peers import torch_models
    from jddp.benchmark import models

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ddp = DDP(torch_models.build("mlp", models.init_params("mlp")))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    rows = 256 // world
    host = models.synthetic_batches(1, 256)[0]
    x = torch.from_numpy(host["x"][rank * rows : (rank + 1) * rows])
    y = torch.from_numpy(host["y"][rank * rows : (rank + 1) * rows]).long()
    optimizer.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    optimizer.step()
    if rank == 0:
        print(f"FIRST STEP {time.time():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--jddp-worker"]:
        _jddp_worker()
    elif sys.argv[1:2] == ["--torch-worker"]:
        _torch_worker()
    else:
        main()
