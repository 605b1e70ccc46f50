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


# The two tiers (CONTRIBUTING.md, "The two tiers"): a test marked with one of these is in the full tier only; every
# other test is marked `fast` here and runs in the fast tier (`python -m pytest -n 2 -q -m fast`).
FULL_TIER_MARKERS = ("multiprocess", "slow")


def in_full_tier(item) -> bool:
    return any(item.get_closest_marker(m) for m in FULL_TIER_MARKERS)


def pytest_collection_modifyitems(config, items):
    """Marks the fast tier; and runs the tests that start processes, or are marked slow, first (the order is
    otherwise kept): with xdist's work stealing (``--dist worksteal`` in pyproject.toml) the suite then ends on short
    tests, instead of one worker idling while the other works through a queue of multi-process tests (160 s of 570
    once)."""
    for item in items:
        if not in_full_tier(item):
            item.add_marker(pytest.mark.fast)
    items.sort(key=lambda item: not in_full_tier(item))


class StartsAProcess(AssertionError):
    """A test of the fast tier started a process."""


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """The fast tier's rule, enforced in every run: a test not marked ``multiprocess`` (or ``slow``) starts no
    process. ``subprocess`` starts children through its ``_fork_exec`` (or ``os.posix_spawn``),
    ``multiprocessing`` (spawn, forkserver) through ``_posixsubprocess.fork_exec``, its fork method through
    ``os.fork``; ``os.system`` through C. A test that needs a process says so with the marker, so that ``-m fast``
    stays fast and needs no launcher."""
    if in_full_tier(request.node):
        return
    import _posixsubprocess

    def refuse(*args, **kwargs):
        raise StartsAProcess(
            f"{request.node.nodeid} starts a process but is not marked: mark it `@pytest.mark.multiprocess` (or "
            "`slow`), so the fast tier (`-m fast`, CONTRIBUTING.md) leaves it out."
        )

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)
    monkeypatch.setattr(subprocess, "_fork_exec", refuse)
    for name in ("fork", "posix_spawn", "posix_spawnp", "system"):
        monkeypatch.setattr(os, name, refuse)


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
