"""Worker: writes in-memory snapshots of a 16 MB state in a loop until it is killed.

    python tests/workers/snapshot_writer.py BASE

Every value of the snapshot of step s is s (``tests/test_snapshot.py`` checks what a kill leaves). Each pwrite of
the writer is done in two halves with a pause between, after printing HALF: a SIGKILL sent when the line arrives
lands in the middle of a write.
"""

import os
import sys
import time

import jax
import jax.numpy as jnp

from jddp.checkpoint import snapshot

jax.config.update("jax_num_cpu_devices", 8)  # as the test that reads the snapshots


class SlowOs:
    """``os`` for the snapshot writer, with each pwrite cut in two halves and a pause after the first."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def pwrite(fd, data, offset):
        half = len(data) // 2
        os.pwrite(fd, bytes(data[:half]), offset)
        print("HALF", flush=True)
        time.sleep(0.2)
        return half + os.pwrite(fd, bytes(data[half:]), offset + half)


snapshot.os = SlowOs()
snaps = snapshot.Snapshots(sys.argv[1], "killed-writer", fingerprint=None, budget=0.01)
step = 0
while True:
    step += 1
    tree = {"a": jnp.full((2048, 2048), step, jnp.float32), "b": jnp.full((1024,), step, jnp.int32)}
    snaps.take(step, tree, {"position": step}, None)
