"""The persistent compilation cache jddp turns on (jddp.runtime.compile_cache): a second run compiles nothing,
and no entry is ever left half written."""

from __future__ import annotations

import json
import os

import jax
import pytest

from jddp.runtime import compile_cache, jax_internals
from tests import multiprocess

WORKER = str(multiprocess.WORKERS / "compile_cache.py")


def run(nprocs: int, said: str | None = None, **env: str) -> list[dict]:
    """The worker's cache counts on each process; with ``said``, the cache's line process 0 printed once."""
    codes, outputs = multiprocess.collect(multiprocess.spawn(WORKER, nprocs, 2, **env), timeout=300)
    assert codes == [0] * nprocs, multiprocess.show(codes, outputs)
    if said is not None:  # once at start, on process 0 only
        lines = [[line for line in o.splitlines() if line.startswith("jddp: compilation cache")] for o in outputs]
        assert lines == [[f"jddp: compilation cache {said}"]] + [[]] * (nprocs - 1), lines
    return [counts(o) for o in outputs]


def counts(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("CACHE ")).split(" ", 1)[1])


@pytest.mark.multiprocess
@pytest.mark.parametrize("nprocs", [1, 2])
def test_a_second_run_reaches_its_first_step_without_compiling(tmp_path, nprocs):
    env = {"JDDP_COMPILATION_CACHE": str(tmp_path / "xla")}
    where = f"in {tmp_path / 'xla'} (JDDP_COMPILATION_CACHE: another directory, or 0 for none)"
    first = run(nprocs, where, **env)
    assert all(c["requests"] > 0 and c["hits"] < c["requests"] for c in first), first  # a fresh cache compiled
    assert list((tmp_path / "xla").glob("*-cache"))
    assert not list((tmp_path / "xla").glob(".*.tmp"))
    second = run(nprocs, **env)
    assert all(c["requests"] > 0 and c["hits"] == c["requests"] for c in second), second  # compiled nothing
    if nprocs > 1:
        return  # off is off on every process: one process shows it without another cold compile of two
    home = str(tmp_path / "home")
    off = run(nprocs, "off (JDDP_COMPILATION_CACHE=0)", JDDP_COMPILATION_CACHE="0", XDG_CACHE_HOME=home)
    assert all(c["hits"] == 0 for c in off) and not (tmp_path / "home").exists()  # off: no default directory


def test_cache_entries_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from jax._src import lru_cache  # the class whose writes jddp makes atomic

    assert jax_internals.make_cache_writes_atomic()
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    cache.put("a", b"x" * 1000)
    assert cache.get("a") == b"x" * 1000
    cache.put("a", b"other")  # an entry is never rewritten
    assert cache.get("a") == b"x" * 1000

    def killed(src, dst):
        raise KeyboardInterrupt("the process dies between the write and the rename")

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        cache.put("b", b"y" * 1000)
    monkeypatch.undo()
    assert cache.get("b") is None  # no truncated entry that later runs could not read nor replace
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-cache"]


@pytest.fixture
def restore_cache_config():
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    saved = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in saved.items():
        jax.config.update(n, v)


def test_the_cache_directory_is_chosen_or_left_to_the_script(tmp_path, monkeypatch, restore_cache_config):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("JDDP_COMPILATION_CACHE", "off")
    assert compile_cache.enable() is None and not jax.config.jax_compilation_cache_dir
    monkeypatch.delenv("JDDP_COMPILATION_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home-cache"))
    assert compile_cache.enable() == str(tmp_path / "home-cache" / "jddp" / "xla")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "home-cache" / "jddp" / "xla")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    monkeypatch.setenv("JDDP_COMPILATION_CACHE", str(tmp_path / "elsewhere"))
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.enable() == str(tmp_path / "elsewhere") and (tmp_path / "elsewhere").is_dir()
    jax.config.update("jax_compilation_cache_dir", "/the/scripts/own")
    assert compile_cache.enable() is None and jax.config.jax_compilation_cache_dir == "/the/scripts/own"
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("JDDP_COMPILATION_CACHE", str(blocker / "xla"))
    with pytest.raises(ValueError, match=r"cannot be created .* set \$JDDP_COMPILATION_CACHE"):
        compile_cache.enable()


def test_the_cache_is_named_once_on_process_0_only(tmp_path, monkeypatch, capsys, restore_cache_config):
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.delenv("JDDP_PROCESS_ID", raising=False)
    monkeypatch.setenv("JDDP_COMPILATION_CACHE", str(tmp_path / "xla"))
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setattr(compile_cache, "_said", False)
    compile_cache.enable()
    jax.config.update("jax_compilation_cache_dir", None)
    compile_cache.enable()
    assert capsys.readouterr().err.splitlines() == [
        f"jddp: compilation cache in {tmp_path / 'xla'} (JDDP_COMPILATION_CACHE: another directory, or 0 for none)"
    ]
    for name, value in (("JDDP_PROCESS_ID", "1"), ("SLURM_PROCID", "3"), ("PMI_RANK", "1")):
        with monkeypatch.context() as rank:
            rank.setenv(name, value)
            rank.setattr(compile_cache, "_said", False)
            jax.config.update("jax_compilation_cache_dir", None)
            compile_cache.enable()
            assert capsys.readouterr().err == "", name  # not process 0: says nothing
    monkeypatch.setattr(compile_cache, "_said", False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("JDDP_COMPILATION_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / ".cache"))
    jax.config.update("jax_compilation_cache_dir", None)
    compile_cache.enable()
    assert "jddp: compilation cache in ~/.cache/jddp/xla (" in capsys.readouterr().err
