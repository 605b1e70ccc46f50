"""Test setup for tests/, examples/ and the doctests in jddp/.

Runs before any backend use: 8 simulated CPU devices and strict rank promotion.
"""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_rank_promotion", "raise")

# Worker scripts run in their own processes (tests/multiprocess.py), never in pytest's.
collect_ignore_glob = ["tests/workers/*"]
