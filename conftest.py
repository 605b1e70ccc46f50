"""Test setup for tests/, examples/ and the doctests in jddp/.

Runs before any backend use: 8 simulated CPU devices and strict rank promotion.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import pytest

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


@pytest.fixture(scope="session")
def alone(tmp_path_factory) -> Path:
    """The elastic tests' reference (tests/test_elastic.py, test_elastic_hosts.py, test_slurm_hosts.py):
    ``fit_train.py`` as one process of one device, never interrupted; once per pytest process."""
    from tests import multiprocess
    from tests.test_elastic import BATCHES, FIT_TRAIN

    out = tmp_path_factory.mktemp("alone")
    done = subprocess.run(
        [sys.executable, FIT_TRAIN, str(out), "60"], capture_output=True, text=True, timeout=300,
        env=multiprocess.environment(JDDP_LOCAL_DEVICES="1", **BATCHES), cwd=multiprocess.ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out
