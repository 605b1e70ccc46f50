"""Worker: processes that build their loaders differently get an error at the first batch, on every process.

python loader_disagree.py seed|batch|size|position|skip|skip_one

skip: both read the first batch, then skip 1 (process 0) and 2 (process 1) batches: refused on both.
skip_one: only process 1 skips (time limit 3 s): refused there, naming process 0.
"""

import sys

import jddp

jddp.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402

what = sys.argv[1]
me = jax.process_index()
size = 64 + (8 * me if what == "size" else 0)
loader = jddp.data.DataLoader(
    {"x": np.arange(size, dtype=np.float32)},
    global_batch_size=16 * (1 + me) if what == "batch" else 16,
    seed=me if what == "seed" else 0,  # the classic mistake: a seed per process
)
if what == "position" and me == 1:
    loader.set_state({**loader.get_state(), "position": 2})
try:
    if what in ("skip", "skip_one"):
        next(iter(loader))
        if what == "skip":
            loader.skip(1 + me)
        elif me == 1:
            loader.skip(2, timeout_s=3)
    next(iter(loader))
    print("RESULT accepted", flush=True)
except (ValueError, TimeoutError) as error:
    print("RESULT refused", str(error).split(". ")[0], flush=True)
jddp.barrier("end", timeout_s=60)  # the one that did not skip waits for the other's time limit
