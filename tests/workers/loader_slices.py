"""Worker: each process reads only its slice; the assembled global batch equals one process's."""

import json
import sys

import jddp

jddp.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from jddp.data.sampler import DistributedBatchSampler  # noqa: E402
from tests.test_loader import CountingSource  # noqa: E402

src = CountingSource(70)
# prefetch=0: no read-ahead (into the next epoch), so the reads are exactly this epoch's.
loader = jddp.data.DataLoader(src, global_batch_size=16, seed=7, drop_last=False, prefetch=0)
assert src.reads == [0]  # construction reads one record to check its fields' dtypes
src.reads.clear()
reference = DistributedBatchSampler(70, global_batch_size=16, seed=7, drop_last=False)
for position, batch in enumerate(loader):
    rows = multihost_utils.process_allgather(batch["x"], tiled=True)
    mask = multihost_utils.process_allgather(batch["mask"], tiled=True)
    ref = reference.local_batch(position)
    np.testing.assert_array_equal(rows, src.data["x"][ref.indices])
    np.testing.assert_array_equal(mask, ref.mask)
# The array fast path (blocks gathered by NumPy, direct transfer) assembles the same global batches.
arrays = jddp.data.DataLoader(src.data, global_batch_size=16, seed=7, drop_last=False)
for position, batch in enumerate(arrays):
    rows = multihost_utils.process_allgather(batch["y"], tiled=True)
    np.testing.assert_array_equal(rows, src.data["y"][reference.local_batch(position).indices])
direct = arrays._transfer._plan(batch.data.shape[1]) is not None
result = {"process": jax.process_index(), "reads": src.reads, "batches": position + 1, "direct": direct}
print("RESULT " + json.dumps(result))
sys.stdout.flush()
