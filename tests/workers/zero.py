"""Worker: ZeRO-1 against the replicated engine in a group of processes, and a sharded checkpoint.

    python tests/workers/zero.py OUT

For SGD with momentum and AdamW with clipping, each with ``accumulate_steps`` 1
and 4, and schedule-free AdamW (whose state holds a copy of the parameters),
trains ``tests.models.odd`` (widths no device count here divides) for 20 steps
with both engines on the same global batches, whose real examples are spread
unevenly (the first device's slice all padding). Every process writes
OUT/zero-<process>.json: per configuration, the largest difference between the
engines' parameters and between their metrics. Process 0 writes
OUT/params.npz (each configuration's sharded-engine parameters). Then it saves
the AdamW sharded state after 10 steps to OUT/ckpt, for a restore onto other
process and device counts.
"""

import json
import os
import sys

import jddp

jddp.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from tests import models  # noqa: E402

out = sys.argv[1]
mesh = jddp.data_mesh()
model = models.odd()
OPTIMIZERS = {
    "sgd-momentum": (lambda: optax.sgd(0.1, momentum=0.9), None),
    "adamw-clip": (lambda: optax.adamw(3e-3, weight_decay=0.1), 0.5),
    # Its state holds a copy of the parameters (z), so each process's slices differ from the first step on.
    "schedule-free": (lambda: optax.contrib.schedule_free_adamw(3e-3), None),
}
RUNS = [("sgd-momentum", 1), ("sgd-momentum", 4), ("adamw-clip", 1), ("adamw-clip", 4), ("schedule-free", 1)]


def global_batches(count: int, n: int = 96):
    """The same global batches on every process, each process placing the rows of its own devices."""
    sharding = jddp.runtime.batch_sharding(mesh)
    out = []
    for seed in range(count):
        host = models.batch(n, seed, models.uneven_mask(n, seed, 4))  # as tests/test_zero.py builds them
        out.append({k: jax.make_array_from_callback(v.shape, sharding, lambda i, v=v: v[i]) for k, v in host.items()})
    return out


def host(tree):
    """A replicated tree's values, from this process's first copy."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_shards[0].data), tree)


def train(dp, data, state=None):
    state = dp.init(model.params, rng=0) if state is None else state
    metrics = []
    for b in data:
        state, m = dp.step(state, b)
        metrics.append(dict(m))
    return state, metrics


data = global_batches(20)
report, saved, engines = {}, {}, {}
for name, accumulate in RUNS:
    make, clip = OPTIMIZERS[name]
    runs = {}
    for shard in (False, True):
        dp = jddp.DataParallel(
            model.loss_fn, make(), mesh=mesh, accumulate_steps=accumulate, clip_grad_norm=clip, shard_optimizer=shard
        )
        engines[name, accumulate, shard] = dp
        state, metrics = train(dp, data)
        dp.check_replicas(state)
        runs[shard] = host(state.params), metrics
    key = f"{name}-{accumulate}"
    report[key] = {
        "params": models.max_diff(runs[False][0], runs[True][0]),
        "moved": models.max_diff(runs[False][0], model.params),
        "metrics": max(abs(a[k] - b[k]) for a, b in zip(runs[False][1], runs[True][1], strict=True) for k in a),
    }
    saved.update({f"{key}/{path}": v for path, v in models.flat(runs[True][0]).items()})

rank = jax.process_index()
with open(os.path.join(out, f"zero-{rank}.json"), "w") as f:
    json.dump(report, f)
if rank == 0:
    np.savez(os.path.join(out, "params.npz"), **saved)

dp = engines["adamw-clip", 1, True]  # the engine of the run above: no second compilation
state, _ = train(dp, data[:10])
with jddp.Checkpointer(os.path.join(out, "ckpt")) as ckpt:
    ckpt.save(state, wait=True)
print(f"DONE {rank}", flush=True)
