"""How does jddp's step compare with hand-written JAX and PyTorch DDP on the same models and batches?

jddp against hand-written JAX and PyTorch DDP: the same MLP and CNN, the same batches, interleaved.

For each process count (``--processes 1,2``) one group of processes is started
through ``jddp launch`` (one CPU device per process). Every process joins
JAX's group (``jddp.initialize``: ``jax.distributed`` with gloo) and PyTorch's
(``torch.distributed`` with gloo), then, for each model, trains

* ``jddp``: ``DataParallel.step`` with default options (one fused all-reduce buffer when the
  mesh spans several processes; per leaf in one process);
* ``jddp per-leaf``: the same with ``fuse_allreduce=False`` (one buffer per
  leaf: jddp before the fused all-reduce);
* ``jax``: a hand-written ``jit(shard_map)`` step (varying params, value_and_grad, one ``pmean``, optax);
* ``torch``: ``DistributedDataParallel`` on the same initial weights, ``AdamW``;

from the same parameters on the same global batches (each process its slice),
AdamW with lr 1e-3 and weight decay 1e-4 in all three. First the losses of
the first steps are compared (the same math must give the same loss), then
``--rounds`` timed runs of ``--steps`` steps per variant alternate in order.
Prints median ms per step, the p10-p90 range and each variant's step-time
ratio to ``jax`` and to ``torch`` (below 1: faster).

    python -m benchmarks peers --processes 1,2 --models mlp,cnn --rounds 9

PyTorch runs with ``--torch-threads`` intra-op threads (default 1, what
``torchrun`` sets for several processes): on this shared 2-core machine 2
threads made its MLP step 10 to 20x slower (OpenMP threads waiting for a busy
core), alone as well as next to JAX. XLA:CPU sizes its own thread pool. Needs the ``bench``
extra (``pip install -e ".[bench]"``, PyTorch's CPU build).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from jddp import net
from jddp.benchmark import models

VARIANTS = ("jddp", "jddp per-leaf", "jax", "torch")
MPI_VARIANT = "jddp mpi"  # with --transport mpi: DataParallel(transport="mpi"), the sum through MPI_Allreduce

QUICK: dict[str, Any] = {"processes": "1", "models": "mlp", "steps": 3, "rounds": 1}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--processes", default="1,2", help="process counts, one device each (default 1,2)")
    p.add_argument("--models", default="mlp,cnn", help="models of jddp bench (default mlp,cnn)")
    p.add_argument("--global-batch-size", type=int, default=256, help="examples per step (default 256)")
    p.add_argument("--steps", type=int, default=20, help="steps per timed run (default 20)")
    p.add_argument("--rounds", type=int, default=9, help="interleaved timed runs per variant (default 9)")
    p.add_argument("--torch-threads", type=int, default=1, help="PyTorch intra-op threads (default 1)")
    p.add_argument(
        "--transport",
        choices=("xla", "mpi"),
        default="xla",
        help="mpi: the group runs under `jddp launch --transport mpi` and adds the `jddp mpi` variant (jddp[mpi])",
    )
    return p


def bench(args: argparse.Namespace) -> Any:
    results = {}
    for nprocs in (int(v) for v in args.processes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "peers.json")
            cmd = [
                sys.executable,
                "-m",
                "jddp.launch",
                "--peer-timeout",
                "120",
                "-n",
                str(nprocs),
                *(["--transport", "mpi"] if args.transport == "mpi" else ["--devices-per-process", "1"]),
            ]
            cmd += ["-m", "benchmarks.peers.run", "--worker", out, str(net.free_port()), args.models]
            cmd += [str(args.global_batch_size), str(args.steps), str(args.rounds), str(args.torch_threads)]
            env = {k: v for k, v in os.environ.items() if not k.startswith("JDDP_")}  # XLA_FLAGS pass through
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"{nprocs} processes failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            with open(out) as f:
                for model, figures in json.load(f).items():
                    results[f"{model} x{nprocs}"] = figures
    print(f"global batch {args.global_batch_size}, {args.rounds} rounds x {args.steps} steps, interleaved; one CPU "
          f"device per process, torch threads {args.torch_threads}; ms per step: median [p10, p90]")  # fmt: skip
    print(f"{'model x procs':<14}{'variant':<15}{'median':>8}{'p10':>8}{'p90':>8}{'/ jax':>8}{'/ torch':>8}")
    for name, r in results.items():
        for v in [v for v in (*VARIANTS, MPI_VARIANT) if v in r]:
            med, jax_med, torch_med = r[v]["median"], r["jax"]["median"], r["torch"]["median"]
            print(f"{name:<14}{v:<15}{med:>8.3f}{r[v]['p10']:>8.2f}{r[v]['p90']:>8.2f}"
                  f"{med / jax_med:>8.3f}{med / torch_med:>8.3f}")  # fmt: skip
        print(f"{'':<14}first losses agree to {r['loss_diff']:.1e}; final losses: "
              + ", ".join(f"{v} {loss:.5f}" for v, loss in r["final_loss"].items()))  # fmt: skip
    return results


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


# ----------------------------------------------------------------- worker


def _optimizers(model: str):
    """The optax and PyTorch optimizers of ``model``: SGD with momentum for ``mlp784`` (the issue's DDP comparison),
    AdamW for the others."""
    import optax
    import torch

    if model == models.WIDE:
        return optax.sgd(0.01, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9)
    return optax.adamw(1e-3, weight_decay=1e-4), lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=1e-4)


def _setup_jax(model: str, params: dict, batches: list[dict], mpi: bool):
    """jddp's and the hand-written JAX step, each as ``(step(carry, batch) -> (carry, loss), carry)``."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jddp

    optimizer = _optimizers(model)[0]
    mean_loss = functools.partial(models.mean_loss, model)
    loss_fn = lambda p, s, b, r: (mean_loss(p, b), (s, {}))
    dp = jddp.DataParallel(loss_fn, optimizer, mesh=jddp.data_mesh(), transport="xla")
    # jddp before its fused all-reduce: one all-reduce buffer per leaf.
    per_leaf = jddp.DataParallel(loss_fn, optimizer, mesh=jddp.data_mesh(), fuse_allreduce=False, transport="xla")

    # Hand-written, as a careful JAX user writes it: own mesh, one pmean.
    mesh = Mesh(jax.devices(), ("batch",))
    rep = NamedSharding(mesh, P())
    hand = models.reference_step(mean_loss, optimizer, mesh)
    hand_params = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, rep, lambda i: a[i]), params)
    hand_carry = (hand_params, jax.jit(optimizer.init, out_shardings=rep)(hand_params))

    def hand_step(carry, batch):
        p, o, loss = hand(*carry, batch)
        return (p, o), loss

    variants = {
        "jddp": (dp.step, dp.init(params)),
        "jddp per-leaf": (per_leaf.step, per_leaf.init(params)),
        "jax": (hand_step, hand_carry),
    }
    if mpi:
        via_mpi = jddp.DataParallel(loss_fn, optimizer, mesh=jddp.data_mesh(), transport="mpi")
        variants[MPI_VARIANT] = (via_mpi.step, via_mpi.init(params))
    return variants


def _setup_torch(model: str, params: dict):
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.peers import torch_models

    ddp = DDP(torch_models.build(model, params))
    optimizer = _optimizers(model)[1](ddp.parameters())

    def torch_step(carry, batch):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        return carry, loss

    return torch_step, None


def _bench_model(model: str, data: dict, steps: int, rounds: int, mpi: bool) -> dict:
    """Checks that the variants compute the same losses, then times them interleaved."""
    import jax
    import numpy as np
    import torch
    import torch.distributed as dist

    params = models.init_params(model)
    variants = {**_setup_jax(model, params, data["jddp"], mpi), "torch": _setup_torch(model, params)}
    carries = {k: v[1] for k, v in variants.items()}
    names = (*VARIANTS, MPI_VARIANT) if mpi else VARIANTS
    data = {**data, MPI_VARIANT: data["jddp"]}

    def run(name: str, n: int) -> tuple[float, list]:
        step, carry, losses, pending = variants[name][0], carries[name], [], None
        start = time.perf_counter()
        for i in range(n):
            carry, loss = step(carry, data[name][i % steps])
            losses.append(loss)
            if pending is not None and name != "torch":  # at most 2 steps in flight
                jax.block_until_ready(pending if name == "jax" else pending["loss"])
            pending = loss
        if name != "torch":
            jax.block_until_ready(carry)
        carries[name] = carry
        return (time.perf_counter() - start) * 1e3 / n, losses

    # Same math: global losses of the first steps from the same start agree.
    def global_losses(name: str, losses: list):
        if name == "torch":
            t = torch.stack([x.detach() for x in losses])
            dist.all_reduce(t)
            return (t / dist.get_world_size()).numpy()
        return np.array([float(x if name == "jax" else x["loss"]) for x in losses])

    first = {name: global_losses(name, run(name, 3)[1]) for name in names}
    loss_diff = max(float(np.max(np.abs(first[v] - first["torch"]))) for v in names)
    if loss_diff > 1e-3:
        raise AssertionError(f"{model}: the variants disagree on the first losses: {first}")
    for name in names:  # warm-up
        run(name, steps)
    times = {v: [] for v in names}
    final = {}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            elapsed, losses = run(name, steps)
            times[name].append(elapsed)
            final[name] = float(global_losses(name, losses[-1:])[0])
    figures = {v: {"median": statistics.median(t), "p10": float(np.percentile(t, 10)),
                   "p90": float(np.percentile(t, 90)), "runs": t} for v, t in times.items()}  # fmt: skip
    figures["jddp/jax"] = figures["jddp"]["median"] / figures["jax"]["median"]
    figures["jddp/torch"] = figures["jddp"]["median"] / figures["torch"]["median"]
    figures["per-leaf/torch"] = figures["jddp per-leaf"]["median"] / figures["torch"]["median"]
    if mpi:
        figures["mpi/torch"] = figures[MPI_VARIANT]["median"] / figures["torch"]["median"]
    figures["loss_diff"] = loss_diff
    figures["final_loss"] = final  # each variant took the same number of steps from the same start
    return figures


def _worker(out: str, port: str, model_names: str, global_batch: str, steps: str, rounds: str, threads: str) -> None:
    import jddp

    jddp.initialize(verbose=False)
    import jax
    import torch
    import torch.distributed as dist

    nprocs, rank = jax.process_count(), jax.process_index()
    torch.set_num_threads(int(threads))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs)
    global_batch, steps, rounds = int(global_batch), int(steps), int(rounds)
    rows = global_batch // nprocs
    sharding = jddp.batch_sharding(jddp.data_mesh())
    mpi = os.environ.get("JDDP_TRANSPORT") == "mpi"  # set by jddp launch --transport mpi

    def data_of(model: str) -> dict:
        host = models.synthetic_batches(steps, global_batch, width=models.features(model))
        local = [{k: v[rank * rows : (rank + 1) * rows] for k, v in b.items()} for b in host]
        data = {
            "jddp": [{k: jax.make_array_from_process_local_data(sharding, v, host[0][k].shape)
                      for k, v in b.items()} for b in local],
            "torch": [{"x": torch.from_numpy(b["x"]), "y": torch.from_numpy(b["y"]).long()} for b in local],
        }  # fmt: skip
        data["jax"] = data["jddp per-leaf"] = data["jddp"]
        return data

    results = {model: _bench_model(model, data_of(model), steps, rounds, mpi) for model in model_names.split(",")}
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(*sys.argv[2:])
    else:
        main()
