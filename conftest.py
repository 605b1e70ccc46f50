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
