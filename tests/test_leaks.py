"""Memory that frequent saves must not keep: TensorStore's JSON reference leak under Orbax, plugged by
``jddp.checkpoint.storage`` (its module docstring), and what a run of saves keeps per save.

``benchmarks/soak.py`` measures the same over 20,000 steps under ``jddp launch``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

import jddp
from jddp.checkpoint import storage
from jddp.runtime import memory

# Calls of the functions Orbax uses, each returning a dict (at some depth) whose string values are fresh objects.
CALLS = {
    "collect_matching_metrics": lambda: ts.experimental_collect_matching_metrics("/tensorstore/", True),
    "kvstore_spec_to_json": lambda: ts.KvStore.Spec({"driver": "file", "path": "/data/ckpt/"}).to_json(),
    "spec_to_json": lambda: ts.Spec({"driver": "zarr", "kvstore": {"driver": "memory", "path": "a/"}}).to_json(),
}


def _strings(value, found: list) -> list:
    """Every string value of every dict in ``value`` (JSON from TensorStore)."""
    if isinstance(value, dict):
        for item in value.values():
            if isinstance(item, str):
                found.append(item)
            _strings(item, found)
    elif isinstance(value, list):
        for item in value:
            _strings(item, found)
    return found


@pytest.mark.parametrize("call", list(CALLS.values()), ids=list(CALLS))
def test_tensorstore_json_holds_no_extra_reference(call):
    # TensorStore 0.1.86 returns every key and value of every dict with one reference too many (never freed): the
    # references are counted exactly, so that too few (a value freed under its dict) fails as well as too many.
    strings = _strings(call(), [])
    assert strings, "the call returned no string to count references of"
    counts = {sys.getrefcount(s) - 1 for s in strings if len(s) > 1}  # minus getrefcount's argument
    assert counts == {2}, f"references of a returned string: {counts} (2: its dict's and the list `strings`)"


def test_tensorstore_json_values_are_unchanged():
    # What the wrapped functions return is what TensorStore returns, to the value.
    assert ts.KvStore.Spec({"driver": "file", "path": "/data/x/"}).to_json() == {"driver": "file", "path": "/data/x/"}
    spec = ts.Spec({"driver": "zarr", "kvstore": {"driver": "memory", "path": "a/"}, "dtype": "float32"}).to_json()
    assert spec == {"driver": "zarr", "dtype": "float32", "kvstore": {"driver": "memory", "path": "a/"}}
    metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/", include_zero_metrics=True)
    assert metrics and all(m["name"].startswith("/tensorstore/kvstore/file/") and m["values"] for m in metrics)
    assert storage.plug_tensorstore_json_leak() == []  # wrapped once, at import: a second call wraps nothing


WARM_UP, SAVES = 8, 20
# Where TensorStore's leaking functions are called: by Orbax, through jddp's wrappers.
LEAK_SITES = (str(Path(ts_utils.__file__)), str(Path(storage.__file__)))


@pytest.mark.slow
def test_saves_keep_no_memory_per_save(tmp_path):
    # One process, a small state, an async save at every step: what the Python heap keeps per save after a
    # warm-up (tracemalloc, by file). TensorStore's leak kept about 17 KB per save here: the values of 24 metrics
    # and the strings of every KvStore spec Orbax builds.
    mesh = jddp.data_mesh(jax.devices()[:1])

    def loss_fn(params, model_state, batch, key):
        return jnp.mean((batch["x"] @ params["w"]) ** 2), (model_state, {})

    dp = jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=mesh)
    state = dp.init({"w": np.zeros((4, 2), np.float32)}, rng=0)
    batch = {"x": np.ones((8, 4), np.float32)}

    def saves(count):
        nonlocal state
        for _ in range(count):
            state, _ = dp.step(state, batch)
            ckpt.maybe_save(state)
        ckpt.wait()
        gc.collect()

    with jddp.Checkpointer(tmp_path / "ckpt", save_every=1) as ckpt:
        saves(WARM_UP)
        tracemalloc.start(1)
        try:
            saves(3)
            before = tracemalloc.take_snapshot()
            saves(SAVES)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    own = [tracemalloc.Filter(False, tracemalloc.__file__)]  # the snapshots' own bookkeeping
    grown = after.filter_traces(own).compare_to(before.filter_traces(own), "filename")
    per_save = {str(s.traceback).rsplit(":", 1)[0]: s.size_diff / SAVES for s in grown}
    top = sorted(per_save.items(), key=lambda kv: -kv[1])[:3]
    said = "; ".join(f"{path}: {size:.0f} B" for path, size in top)
    # 15 to 17 KB per save with the leak, 0.2 KB without.
    assert sum(per_save.get(path, 0) for path in LEAK_SITES) < 1000, said
    # Everything the heap keeps: 22 KB per save with the leak, 5 KB without (the warm-up of bounded caches:
    # 0.2 KB per save from save 300 to 600).
    assert sum(per_save.values()) < 11000, said


def test_run_log_keeps_no_key_per_record(tmp_path):
    # RunLog (process 0's metrics.jsonl) kept the key of every record it wrote, to write each once: about 60 B per
    # record, without bound in a long run. Only the keys at the last step written can come again (fit's records come
    # in step order): what it keeps per record is counted after a warm-up, and what it must still skip is checked.
    from jddp import logs

    first = logs.RunLog(tmp_path, 0, "r")
    first.write({"step": 5, "epoch": 0.5, "split": "eval", "loss": 1.0})
    first.close()
    log = logs.RunLog(tmp_path, 5, "r")  # resumed at step 5: its eval there is written already
    log.write({"step": 5, "epoch": 0.5, "split": "eval", "loss": 2.0})

    def write(steps):
        for step in steps:
            log.write({"step": step, "epoch": step / 10, "split": "train", "loss": 1.0})

    write(range(6, 56))
    tracemalloc.start(1)
    try:
        before = tracemalloc.take_snapshot()
        write(range(56, 556))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    log.write({"step": 555, "epoch": 55.5, "split": "train", "loss": 3.0})  # the same step and split again
    log.close()
    kept = sum(s.size_diff for s in after.compare_to(before, "filename") if s.traceback[0].filename == logs.__file__)
    assert kept / 500 < 8, f"RunLog keeps {kept / 500:.0f} B per record written"
    records = logs.read_metrics(tmp_path / logs.METRICS_FILE)
    assert [(r["step"], r["loss"]) for r in records if r["step"] in (5, 555)] == [(5, 1.0), (555, 1.0)]
    assert [r["step"] for r in records] == [5, *range(6, 556)]


def test_fit_history_keeps_the_last_records(tmp_path, monkeypatch):
    # FitResult.history kept every record of the call (one per log_every steps, and per evaluation and epoch): about
    # 0.1 MB per 1000 steps, without bound. It keeps the last HISTORY_KEEP, the same as the end of metrics.jsonl.
    from jddp import fit_outputs, logs

    monkeypatch.setattr(fit_outputs, "HISTORY_KEEP", 5)
    mesh = jddp.data_mesh(jax.devices()[:1])

    def loss_fn(params, model_state, batch, key):
        return jnp.mean((batch["x"] @ params["w"] - 1) ** 2), (model_state, {})

    dp = jddp.DataParallel(loss_fn, optax.sgd(0.1), mesh=mesh)
    state = dp.init({"w": np.zeros((4, 2), np.float32)}, rng=0)
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    loader = jddp.data.DataLoader({"x": x}, global_batch_size=8, seed=1, mesh=mesh)
    result = jddp.fit(dp, state, loader, steps=20, log_every=2, log_dir=tmp_path, progress=False)
    logged = [r for r in logs.read_metrics(tmp_path / logs.METRICS_FILE) if not r["split"].startswith("goodput")]
    assert len(logged) == 10 + 2  # a train record every 2 steps, a train_epoch one every 8
    assert result.history == [{k: v for k, v in r.items() if k != "run"} for r in logged[-5:]]


# A heap fragmented as a long run of saves leaves it: blocks of many sizes freed between small ones still in use,
# under jddp launch's allocator settings (nothing returned to the system by itself). In a process of its own:
# glibc reads GLIBC_TUNABLES at a process's start.
FRAGMENT = r"""
import ctypes, os, sys
from jddp.runtime import memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
page = os.sysconf("SC_PAGE_SIZE")
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * page / 2**20
big, small = [], []
for i in range(64):
    size = (1 + i % 3) << 20
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    big.append(block)
    small.append(libc.malloc(64))  # still in use after the big ones go: no big block can merge with the top
for block in big:
    libc.free(block)
before = rss()
trimmer = memory.Trimmer(every=float(sys.argv[1]), clock=iter([0.0, 0.0, 30.0, 61.0, 61.0]).__next__)
trimmed = [trimmer.maybe(), trimmer.maybe(), trimmer.maybe()]  # at 0 s, 30 s and 61 s after the start
print(before, rss(), *trimmed)
"""


@pytest.mark.multiprocess  # starts a process of its own
def test_trimmer_returns_a_fragmented_heap(tmp_path):
    # 128 MB freed inside the heap stays resident under the launcher's settings until the trimmer is due: red with
    # the trim call removed (no MB returned) or made before `every` seconds have passed (a trim at 0 or 30 s).
    from jddp.cli.launch import MALLOC_TUNABLES

    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES}
    done = subprocess.run([sys.executable, "-c", FRAGMENT, "60"], env=env, capture_output=True, text=True, check=True)
    before, after, *trimmed = done.stdout.split()
    assert float(before) > 128, f"the freed blocks were not resident: {done.stdout}"
    assert trimmed == ["False", "False", "True"], f"trimmed at 0 s, 30 s, 61 s: {trimmed}"
    assert float(before) - float(after) > 120, f"resident MB before and after the trim: {before}, {after}"


def test_maybe_save_trims_the_heap(tmp_path, monkeypatch):
    # Checkpointer.maybe_save lets its trimmer trim, once per step: red with the call removed.
    calls = []
    monkeypatch.setattr(memory.Trimmer, "maybe", lambda self: calls.append(self) or False)
    mesh = jddp.data_mesh(jax.devices()[:1])
    state = jddp.DataParallel(lambda p, s, b, k: (0.0, (s, {})), optax.sgd(0.1), mesh=mesh).init(
        {"w": np.zeros(2, np.float32)}, rng=0
    )
    with jddp.Checkpointer(tmp_path / "ckpt", save_every=None, snapshots=False) as ckpt:
        for _ in range(3):
            ckpt.maybe_save(state)
        assert len(calls) == 3 and {id(c) for c in calls} == {id(ckpt._trimmer)}
