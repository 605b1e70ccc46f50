"""Worker: process 1 calls ``sys.exit(0)`` while process 0 waits in a collective of the script's own
(``multihost_utils.process_allgather``, outside jddp's calls): ``tests/test_launch.py``."""

import sys
import time

import numpy as np

import jddp

jddp.initialize()

from jax.experimental import multihost_utils  # noqa: E402

if jddp.process_index() == 1:
    print("process 1 exits 0 early", flush=True)
    sys.exit(0)
time.sleep(1)
print("process 0 waits in multihost_utils.process_allgather", flush=True)
start = time.time()
multihost_utils.process_allgather(np.ones(3))
print("process 0 returned after", time.time() - start, flush=True)
