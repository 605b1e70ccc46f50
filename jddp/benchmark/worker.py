"""One ``jddp bench`` configuration, run in every process of the group that ``jddp launch`` starts.

    python -m jddp.benchmark.worker --model mlp --out RESULT.json \
        --batch_per_device 64 --steps 20 --warmup 5 --rounds 5

Times ``jddp`` (``DataParallel.step``), ``hand`` (``models.reference_step``)
and ``local`` (the same without its ``pmean``) on the same pre-placed global
batches, as ``jddp.cli.bench`` describes; process 0 writes the raw timings to
``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Any

from jddp import envvars
from jddp.benchmark import custom, models


def check_no_collective(hlo: str) -> None:
    """Raises ``RuntimeError`` if the compiled HLO text holds a collective."""
    ops = {op: hlo.count(f"{op}(") for op in ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")}
    if any(ops.values()):
        raise RuntimeError(f"The step without pmean must have no collective, but its compiled HLO has {ops}.")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jddp.benchmark.worker", description="One jddp bench configuration.")
    p.add_argument("--model", required=True, help="mlp, cnn, or MODULE:FUNCTION (jddp.benchmark.custom)")
    p.add_argument("--out", required=True, help="JSON file process 0 writes the raw timings to")
    for name in ("batch_per_device", "steps", "warmup", "rounds"):
        minimum = 0 if name == "warmup" else 1
        p.add_argument(
            f"--{name}", type=envvars.count(minimum), required=True, help=f"as jddp bench's --{name.replace('_', '-')}"
        )
    return p


def _mean_loss(loss_fn, model_state, params, batch):
    """A jddp ``loss_fn``'s loss as the mean ``models.reference_step`` takes (a ``Weighted`` pair divided out), at
    the initial ``model_state`` and a fixed key: the hand-written steps do not carry model state."""
    import jax

    import jddp

    loss, _ = loss_fn(params, model_state, batch, jax.random.key(0))
    return loss.total / loss.weight if isinstance(loss, jddp.Weighted) else loss


def _builtin_loss(mean_loss, params, model_state, batch, rng):
    """A built-in model's mean loss as a jddp ``loss_fn``."""
    return mean_loss(params, batch), (model_state, {})


def _hand_program(loss, optimizer, mesh, params: dict, batch: dict, *, reduce: bool) -> tuple[Any, tuple, float]:
    """``models.reference_step`` compiled for ``batch``, its replicated ``(params, opt_state)``, compile seconds.

    The step without ``pmean`` (``reduce=False``) is checked to hold no
    collective: the comparison only means something if ``local`` has none.
    """
    import jax

    import jddp

    rep = jddp.replicated(mesh)
    hand_params = jax.tree.map(lambda a: jax.make_array_from_callback(a.shape, rep, lambda idx: a[idx]), params)
    carry = (hand_params, jax.jit(optimizer.init, out_shardings=rep)(hand_params))
    step = models.reference_step(loss, optimizer, mesh, reduce=reduce)
    t = time.perf_counter()
    compiled = step.lower(*carry, batch).compile()
    if not reduce:
        hlo = compiled.as_text()
        if hlo is None:
            raise RuntimeError("The backend gives no compiled HLO text to check for collectives.")
        check_no_collective(hlo)
    return compiled, carry, time.perf_counter() - t


def _time(programs: dict, carries: dict, batches: list, *, steps: int, warmup: int, rounds: int) -> tuple:
    """Per-step ms of each program over interleaved rounds, jddp's latencies (ms), and jddp's compile seconds."""
    import jax

    def run(name: str, n: int, latencies: list | None = None) -> float:
        """Runs ``n`` steps of one program; returns ms per step (latencies: wait for each step)."""
        carry, pending = carries[name], None
        start = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            carry, out = programs[name](carry, batches[i % len(batches)])
            if latencies is not None:
                jax.block_until_ready(carry)
                latencies.append((time.perf_counter() - t) * 1e3)
            elif pending is not None:  # at most 2 steps in flight, as jddp's dispatcher
                jax.block_until_ready(pending)
            pending = out
        jax.block_until_ready(carry)
        carries[name] = carry
        return (time.perf_counter() - start) * 1e3 / n

    compile_s = run("jddp", 1) / 1e3
    for name in programs:
        run(name, max(warmup, 1))
    times: dict[str, list[float]] = {k: [] for k in programs}
    latencies: list[float] = []
    names = list(programs)
    for r in range(rounds):  # alternate the order so that no program always runs first
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(run(name, steps))
        run("jddp", steps, latencies)
    return times, latencies, compile_s


def main(argv: list[str] | None = None) -> int:
    """Runs one configuration in this process of the group; process 0 writes the raw timings to ``--out``."""
    args = get_args_parser().parse_args(argv)
    import jddp

    jddp.initialize(verbose=False)
    import jax
    import numpy as np
    import optax

    mesh, n, pc, pi = jddp.data_mesh(), jax.device_count(), jax.process_count(), jax.process_index()
    bsh = jddp.batch_sharding(mesh)
    gb, rows = args.batch_per_device * n, args.batch_per_device * n // pc

    def place(a):  # this process's rows of the global batch
        return jax.make_array_from_process_local_data(bsh, a[pi * rows : (pi + 1) * rows], a.shape)

    if custom.is_spec(args.model):
        user = custom.load(args.model)
        data = [custom.global_batch(user, args.model, gb)]
        optimizer = user.optimizer or optax.adamw(1e-3, weight_decay=1e-4)
        # Host copies: the programs donate their state, which must not delete the caller's arrays.
        params, model_state = jddp.models.to_host(user.params), jddp.models.to_host(user.model_state)
        loss_fn = user.loss_fn
        mean_loss = functools.partial(_mean_loss, loss_fn, model_state)
    else:
        data = models.synthetic_batches(args.steps, gb)
        optimizer = optax.adamw(1e-3, weight_decay=1e-4)
        params, model_state = models.init_params(args.model), None
        mean_loss = functools.partial(models.mean_loss, args.model)
        loss_fn = functools.partial(_builtin_loss, mean_loss)
    batches = [{k: place(v) for k, v in b.items()} for b in data]
    dp = jddp.DataParallel(loss_fn, optimizer, mesh=mesh)
    hand, hand_carry, hand_compile_s = _hand_program(mean_loss, optimizer, mesh, params, batches[0], reduce=True)
    local, local_carry, _ = _hand_program(mean_loss, optimizer, mesh, params, batches[0], reduce=False)
    carries = {"jddp": dp.init(params, model_state), "hand": hand_carry, "local": local_carry}
    programs = {
        "jddp": lambda c, b: (dp.step(c, b)[0], None),
        "hand": lambda c, b: (lambda r: (r[:2], r[2]))(hand(*c, b)),
        "local": lambda c, b: (lambda r: (r[:2], r[2]))(local(*c, b)),
    }
    times, latencies, compile_s = _time(
        programs, carries, batches, steps=args.steps, warmup=args.warmup, rounds=args.rounds
    )
    if pi == 0:
        result: dict[str, Any] = {f"{k}_ms": v for k, v in times.items()}
        grad_bytes = int(sum(np.asarray(x).nbytes for x in jax.tree.leaves(params)))
        result.update(processes=pc, devices=n, global_batch=gb, latency_ms=latencies, compile_s=compile_s)
        result.update(hand_compile_s=hand_compile_s, grad_bytes=grad_bytes)
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
