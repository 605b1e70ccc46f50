"""A refused call leaves nothing behind: after a refusal for a bad argument (one that passes the early checks and
fails later, after the call took a lease, made a directory or started a thread), the same call with the argument
corrected succeeds in the same process (a notebook), instead of being refused by what the first call left (a lease
"being written by another run: pid <its own>", a thread, a half-made file).

The cases are generated from the source: every function of ``jddp/`` that takes a lease, makes a directory or starts
a thread (``SITE_CALLS``) is a site, and each site is either reached by a refusal case here (``CASES``) or named in
``ELSEWHERE`` with where it is tested instead; a new site fails ``test_every_site_is_covered`` until it is added.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

import jddp
from jddp import config as config_lib
from jddp import goodput_ledger, logs
from tests import multiprocess

SITE_CALLS = {"mkdir", "makedirs", "mkdtemp", "Thread", "Lease"}


def sites() -> set[str]:
    """``module:qualname`` of every function of ``jddp/`` that calls one of ``SITE_CALLS``."""
    found = set()

    def walk(node, module: str, qual: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                walk(child, module, [*qual, child.name])
                continue
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
                if name in SITE_CALLS:
                    found.add(f"{module}:{'.'.join(qual) or '<module>'}")
            walk(child, module, qual)

    package = multiprocess.ROOT / "jddp"
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(multiprocess.ROOT).with_suffix("").parts).removesuffix(".__init__")
        walk(ast.parse(path.read_text()), module, [])
    return found


def _blocker(tmp_path: Path) -> Path:
    """A file: any directory asked for under it cannot be made (the bad argument that only fails when used)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    return blocker


# --------------------------------------------------------------------------------------- refusal cases, in process
# Each: refuse (the call with the bad argument, which must raise), then the corrected call, which must succeed.


def checkpointer_snapshot_dir(tmp_path, monkeypatch):
    """The snapshot directory cannot be made: refused after the directory's lease was taken."""
    monkeypatch.setenv("JDDP_SNAPSHOT_DIR", str(_blocker(tmp_path) / "memory"))
    with pytest.raises(OSError):
        jddp.Checkpointer(tmp_path / "ckpt", snapshots=True)
    monkeypatch.setenv("JDDP_SNAPSHOT_DIR", str(tmp_path / "memory"))
    with jddp.Checkpointer(tmp_path / "ckpt", snapshots=True) as ckpt:
        assert ckpt.all_steps() == []


def checkpointer_directory(tmp_path, monkeypatch):
    """The checkpoint directory cannot be made (under a file)."""
    with pytest.raises(OSError):
        jddp.Checkpointer(_blocker(tmp_path) / "ckpt")
    with jddp.Checkpointer(tmp_path / "ckpt") as ckpt:
        assert ckpt.all_steps() == []


def ledger_directory(tmp_path, monkeypatch):
    """The run's ledger folder cannot be made; a bad ``restored_from`` is refused before anything is made."""
    monkeypatch.delenv("JDDP_LEDGER_NOTE", raising=False)
    with pytest.raises(ValueError, match="restored_from='tape'"):
        goodput_ledger.Ledger(tmp_path / "run", 0, restored_from="tape")
    assert not (tmp_path / "run").exists()
    with pytest.raises(OSError):
        goodput_ledger.Ledger(_blocker(tmp_path) / "run", 0)
    assert goodput_ledger.Ledger(tmp_path / "run", 0).path.name == "attempt-0000.ledger"


def run_log_directory(tmp_path, monkeypatch):
    """``fit``'s log folder cannot be made."""
    with pytest.raises(OSError):
        logs.RunLog(_blocker(tmp_path) / "log", 0, "run")
    log = logs.RunLog(tmp_path / "log", 0, "run")
    log.close()


def config_file_directory(tmp_path, monkeypatch):
    """A config saved where its folder cannot be made: no half-written file is left."""
    cfg = {"a": 1}
    with pytest.raises(OSError):
        config_lib.save(cfg, _blocker(tmp_path) / "d" / "c.yaml")
    config_lib.save(cfg, tmp_path / "d" / "c.yaml")
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["c.yaml"]


CASES: dict[str, Callable[..., None] | str] = {
    "jddp.checkpoint.lease:Lease.acquire": checkpointer_snapshot_dir,
    "jddp.checkpoint.lease:take": checkpointer_snapshot_dir,
    "jddp.checkpoint.snapshot:Snapshots.__init__": checkpointer_snapshot_dir,
    "jddp.checkpoint.storage:check_writable": checkpointer_directory,
    "jddp.goodput_ledger:Ledger.__init__": ledger_directory,
    "jddp.logs:RunLog.__init__": run_log_directory,
    "jddp.config.files:save": config_file_directory,
    # in a fresh interpreter (test_a_refused_initialize_leaves_nothing_behind): JAX's backend is started there
    "jddp.runtime.compile_cache:enable": "initialize",
}
# Sites reached only in a group of processes or in the launcher's process, tested there (multiprocess tier).
ELSEWHERE = {
    "jddp.runtime.coordinator:main": "the coordination service's own process (tests/test_coordinator*.py)",
    "jddp.runtime.coordinator:start_for_parent": "process 0 of a group without jddp launch (tests/test_launch.py)",
    "jddp.runtime.flush:install": "under jddp launch, after the group is joined (tests/test_launch.py)",
    "jddp.runtime.group_link:GroupLink.__init__": "the watchdog of a joined group (tests/test_watchdog*.py)",
    "jddp.runtime.native_stdout:filter_native_stdout": "a group joined without jddp launch (tests/test_launch.py)",
    "jddp.runtime.flight:write_flight_record": "a stalled group's flight record (tests/test_stall*.py)",
    "jddp.cli.bench:run": "jddp bench's parent process (tests/test_bench.py)",
    "jddp.cli.job_token:user_secret": "the launcher's job token (tests/test_job_token*.py)",
    "jddp.cli.launch.mpi:run_mpi": "jddp launch --mpi (tests/test_mpi*.py)",
    "jddp.cli.launch.notes:NoteDir.__init__": "the launcher's process (tests/test_launch.py)",
    "jddp.cli.launch.rendezvous:Client.__init__": "elastic launchers (tests/test_elastic.py)",
    "jddp.cli.launch.rendezvous:Server.__init__": "elastic launchers (tests/test_elastic.py)",
    "jddp.cli.launch.rendezvous:Server._serve": "elastic launchers (tests/test_elastic.py)",
    "jddp.cli.launch.service:ServiceManager.spawn": "the launcher's coordination service (tests/test_launch.py)",
    "jddp.cli.launch.service:ServiceManager.end": "a standby generation's service ended (tests/test_spares.py)",
    "jddp.cli.launch.snapshots:make_locked_dir": "the launcher's snapshot folder (tests/test_snapshot*.py)",
    "jddp.cli.launch.workers:spawn": "the launcher's worker group (tests/test_launch.py)",
    "jddp.cli.launch.zygote:Zygote.start": "the zygote's process and its socket's reader (tests/test_zygote.py)",
    "jddp.cli.launch.zygote:Zygote.fork": "a forked spare's output readers (tests/test_zygote.py)",
    "jddp.cli.reports:ReportServer.__init__": "node launchers' reports (tests/test_nodes*.py)",
    "jddp.cli.reports:ReportServer._serve": "node launchers' reports (tests/test_nodes*.py)",
    "jddp.cli.reports:Subscription.__init__": "node launchers' reports (tests/test_nodes*.py)",
    "jddp.benchmark.noise:LoadSampler.__init__": "the benchmarks' load sampler (tests/test_bench_noise.py)",
}


def test_every_site_is_covered():
    found = sites()
    assert len(found) >= 20, found  # the scan sees the source
    uncovered = sorted(found - set(CASES) - set(ELSEWHERE))
    assert not uncovered, f"functions that take a lease, make a directory or start a thread, with no case: {uncovered}"
    assert not (set(CASES) | set(ELSEWHERE)) - found, "cases for sites that no longer exist"


REFUSALS: list[Callable[..., None]] = sorted({c for c in CASES.values() if not isinstance(c, str)}, key=str)


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: c.__name__)
def test_after_a_refusal_the_corrected_call_succeeds(tmp_path, monkeypatch, case):
    before = {t.ident for t in threading.enumerate()}
    case(tmp_path, monkeypatch)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("jddp-")]
    assert not left, f"{case.__name__}: threads left running after the corrected call's end: {left}"


INITIALIZE = """
import os, threading, jax, jddp
from jddp.runtime import cluster_env, process_group
assert len(jax.devices()) == 1  # the backend runs: initialize's later checks refuse
blocker = os.path.join({tmp!r}, "a-file")
open(blocker, "w").close()
refusals = [
    (dict(local_devices=3), {{}}),  # the backend has 1 device
    (dict(coordinator="127.0.0.1:1", num_processes=2, process_id=0), {{}}),  # too late to join
    ({{}}, {{"JDDP_COMPILATION_CACHE": os.path.join(blocker, "xla")}}),  # the cache's folder cannot be made
]
for kwargs, env in refusals:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        jddp.initialize(**kwargs)
    except (ValueError, RuntimeError) as error:
        print("refused:", type(error).__name__, str(error)[:80])
    else:
        raise SystemExit(f"not refused: {{kwargs}} {{env}}")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert process_group.group() is None
    assert not [t.name for t in threading.enumerate() if t.name.startswith("jddp-")]
assert jddp.initialize() is None
print("corrected call: alone")
"""


@pytest.mark.multiprocess
def test_a_refused_initialize_leaves_nothing_behind(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("JDDP_")}
    env.update(JAX_PLATFORMS="cpu", JDDP_COMPILATION_CACHE=str(tmp_path / "xla"))
    code = textwrap.dedent(INITIALIZE.format(tmp=str(tmp_path)))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=multiprocess.ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("refused:") == 3 and "corrected call: alone" in done.stdout, done.stdout
