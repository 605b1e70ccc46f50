"""Worker: prints its CPU affinity and thread settings as the launcher left them (no JAX)."""

import json
import os

share = {
    "cores": sorted(os.sched_getaffinity(0)),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
}
print("SHARE " + json.dumps(share), flush=True)
