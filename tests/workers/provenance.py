"""Worker: consumes STEPS global batches of a DataLoader and records what this process's devices got.

    python tests/workers/provenance.py OUT TAG STEPS [STATE_JSON]

Starts from the loader state in STATE_JSON if given. Writes OUT/consumed-TAG-<process>.json: for each step (its
global position), the dataset indices ``i`` of the real examples in this process's shards of the batch (read
from the device arrays, padding left out); process 0 writes the loader's state at the end to OUT/state-TAG.json
and ``examples_at`` of every step so far to OUT/examples_at-TAG.json.
"""

import json
import os
import sys

import jddp

jddp.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

out, tag, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
N, BATCH = 45, 8  # 6 batches an epoch, the last one 5 real examples and 3 of padding
source = {"i": np.arange(N, dtype=np.int32), "x": np.random.default_rng(0).normal(size=(N, 3)).astype(np.float32)}
loader = jddp.data.DataLoader(source, global_batch_size=BATCH, seed=3, drop_last=False, mesh=jddp.data_mesh())
if len(sys.argv) > 4:
    with open(sys.argv[4]) as f:
        loader.set_state(json.load(f))

consumed: dict[int, list[int]] = {}
while len(consumed) < steps:
    for batch in loader:
        step = loader.sampler.position - 1  # the position of the batch just handed out
        own = []
        for i_shard, m_shard in zip(batch["i"].addressable_shards, batch["mask"].addressable_shards, strict=True):
            i, mask = np.asarray(i_shard.data), np.asarray(m_shard.data)
            own += i[mask > 0].tolist()
        consumed[step] = own
        if len(consumed) == steps:
            break
rank = jax.process_index()
with open(os.path.join(out, f"consumed-{tag}-{rank}.json"), "w") as f:
    json.dump(consumed, f)
if rank == 0:
    with open(os.path.join(out, f"state-{tag}.json"), "w") as f:
        json.dump(loader.get_state(), f)
    last = loader.sampler.position
    with open(os.path.join(out, f"examples_at-{tag}.json"), "w") as f:
        json.dump({s: loader.examples_at(s).tolist() for s in range(last)}, f)
print(f"DONE {rank}", flush=True)
