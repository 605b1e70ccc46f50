"""Test setup for tests/, examples/ and the doctests in jddp/.

Runs before any backend use: 8 simulated CPU devices and strict rank promotion.
"""

import os
import tempfile

import jax

# The worker processes' compilation cache (jddp.initialize turns one on): one per machine and user for the
# suite, not the user's own ~/.cache/jddp/xla. Tests of the cache itself set their own.
os.environ.setdefault("JDDP_COMPILATION_CACHE", os.path.join(tempfile.gettempdir(), f"jddp-test-xla-{os.getuid()}"))

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# Worker scripts run in their own processes (tests/multiprocess.py), never in pytest's.
collect_ignore_glob = ["tests/workers/*"]


def pytest_collection_modifyitems(config, items):
    """The tests that start processes, or are marked slow, run first (the order is otherwise kept): with xdist's
    work stealing (``--dist worksteal`` in pyproject.toml) the suite then ends on short tests, instead of one
    worker idling while the other works through a queue of multi-process tests (160 s of 570 once)."""
    items.sort(key=lambda item: not any(item.get_closest_marker(m) for m in ("multiprocess", "slow")))
