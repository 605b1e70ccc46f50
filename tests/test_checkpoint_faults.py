"""Every file the checkpoint package writes is read defensively (issue 42): fault injection generated from each
file's format, (file kind x fault), and for each one outcome of three: set aside with a ``CheckpointWarning`` naming
the file while the run goes on (an older snapshot, an older step, the disk), refused with an error naming the file,
or, for a field the restore does not read, the intact restore, bitwise. Never a raw Python error, never garbage
restored.

The files: an in-memory snapshot (``<step>.snap``: a length, a JSON header, the data), a step's metadata
(``<step>/meta/metadata``) and loader position (``<step>/loader/metadata``), the run file ``jddp.run`` and the lease
``jddp.lease``. The faults: truncation at 0 bytes, 1 byte, half and all but one byte; a directory in the file's place;
another format version and another run (where the format has those fields); NaN and garbage in each field of its
JSON, the fields read from the intact file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import jddp
from jddp.checkpoint import identity, lease, restore, snapshot, snapshot_format

pytestmark = pytest.mark.slow  # each case opens a Checkpointer and restores: about a second

SOURCE = {"x": np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)}
SNAPSHOT_STEP, DISK_STEP = 5, 4  # the newest snapshot, the newest step on disk (saves at 2 and 4)


def loss_fn(params, model_state, batch, key):
    return ((batch["x"] @ params["w"]) ** 2).mean(), (model_state, {})


def make():
    mesh = jddp.data_mesh(jax.devices()[:2])
    dp = jddp.DataParallel(loss_fn, optax.adam(0.01), mesh=mesh)
    state = dp.init({"w": np.linspace(-1, 1, 4, dtype=np.float32).reshape(4, 1)})
    return dp, state, jddp.data.DataLoader(SOURCE, global_batch_size=8, seed=1, mesh=mesh)


def host(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(restore.as_dict(state))]


@dataclasses.dataclass
class Base:
    directory: Path
    memory: Path | None
    states: dict[int, list[np.ndarray]]  # the state at each step, on the host
    loaders: dict[int, dict]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Base]:
    """Two runs of 5 steps saving at 2 and 4: one with snapshots at every step (5 and 4 kept), one without."""
    made = {}
    for name in ("memory", "disk"):
        root = tmp_path_factory.mktemp(name)
        memory = root / "memory" if name == "memory" else None
        with pytest.MonkeyPatch.context() as patch:
            if memory is not None:
                patch.setenv("JDDP_SNAPSHOT_DIR", str(memory))
            dp, state, loader = make()
            states, loaders = {}, {}
            ckpt = jddp.Checkpointer(root / "ckpt", save_every=2, snapshot_every=1 if memory else None)
            for _, batch in zip(range(SNAPSHOT_STEP), loader, strict=False):
                state, _ = dp.step(state, batch)
                ckpt.maybe_save(state, loader)
                states[int(state.step)], loaders[int(state.step)] = host(state), loader.get_state()
            ckpt.wait()
            if ckpt._snapshots is not None:
                ckpt._snapshots.wait()
            ckpt._close(remove_snapshots=False)
        made[name] = Base(root / "ckpt", memory, states, loaders)
    return made


# ------------------------------------------------------------------ the files and how each is read back


@dataclasses.dataclass(frozen=True)
class Kind:
    base: str  # which of `bases`
    file: Callable[[Path, Path | None], Path]  # the file, from the checkpoint directory and the snapshots' root
    header: bool = False  # a length and a JSON header before binary data (a snapshot), else all JSON
    version: str | None = None  # the format's version field, if it has one
    run: str | None = None  # the field naming the run, if it has one
    at_open: bool = False  # read when a Checkpointer opens (the lease), not by restore_or_init


def snapshot_file(directory: Path, memory: Path | None) -> Path:
    assert memory is not None
    return next((memory / snapshot._key(directory)).glob(f"process-*/{SNAPSHOT_STEP}{snapshot.SUFFIX}"))


KINDS = {
    "snapshot": Kind("memory", snapshot_file, header=True, version="format", run="run"),
    "meta": Kind("disk", lambda d, m: d / str(DISK_STEP) / restore.META / "metadata", version="format", run="run"),
    "loader": Kind("disk", lambda d, m: d / str(DISK_STEP) / restore.LOADER / "metadata"),
    "run file": Kind("disk", lambda d, m: d / identity.FILENAME, version="format", run="run"),
    "lease": Kind("disk", lambda d, m: d / lease.FILENAME, at_open=True),
}


def live_lease(directory: Path) -> None:
    """A lease as a writer on another host holds it, its heartbeat fresh."""
    owner = {"id": "f" * 32, "host": "elsewhere." + socket.gethostname(), "pid": 4242, "started": None}
    owner.update(processes=1, taken=time.time())
    (directory / lease.FILENAME).write_text(json.dumps(owner))


def read_json(kind: Kind, data: bytes) -> tuple[dict, bytes]:
    """The file's JSON object, and the bytes after it (a snapshot's data)."""
    if not kind.header:
        return json.loads(data), b""
    (length,) = snapshot_format.HEADER_LENGTH.unpack_from(data, 0)
    start = snapshot_format.HEADER_LENGTH.size
    return json.loads(data[start : start + length]), data[start + length :]


def write_json(kind: Kind, path: Path, obj: dict, rest: bytes) -> None:
    text = json.dumps(obj).encode()
    path.write_bytes(snapshot_format.HEADER_LENGTH.pack(len(text)) + text + rest if kind.header else text)


# ------------------------------------------------------------------ the faults, generated from each file


def truncate(size: Callable[[int], int]):
    def fault(kind: Kind, path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: size(len(data))])

    return fault


def directory_instead(kind: Kind, path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "inside").write_text("{}")


def field(name: str, value):
    def fault(kind: Kind, path: Path) -> None:
        obj, rest = read_json(kind, path.read_bytes())
        obj[name] = value
        write_json(kind, path, obj, rest)

    return fault


def other_version(name: str):
    def fault(kind: Kind, path: Path) -> None:
        obj, rest = read_json(kind, path.read_bytes())
        obj[name] = obj[name] + 1
        write_json(kind, path, obj, rest)

    return fault


TRUNCATIONS = {"0 bytes": lambda n: 0, "1 byte": lambda n: 1, "half": lambda n: n // 2, "all but one": lambda n: n - 1}


def faults(kind_name: str, intact: bytes):
    kind = KINDS[kind_name]
    for name, size in TRUNCATIONS.items():
        yield name, truncate(size)
    yield "a directory", directory_instead
    if kind.version is not None:
        yield "another version", other_version(kind.version)
    if kind.run is not None:
        yield "another run", field(kind.run, identity.new_run_id())
    obj, _ = read_json(kind, intact)
    for key in obj:
        yield f"{key}=NaN", field(key, math.nan)
        yield f"{key}=garbage", field(key, "garbage \x00\ufffd")


def intact_files() -> dict[str, bytes]:
    """Each kind's intact file, from a small run made here at collection (the fields are the format's, not a list
    written by hand)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as patch:
        root = Path(tmp)
        patch.setenv("JDDP_SNAPSHOT_DIR", str(root / "memory"))
        dp, state, loader = make()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ckpt = jddp.Checkpointer(root / "ckpt", save_every=2, snapshot_every=1)
            for _, batch in zip(range(SNAPSHOT_STEP), loader, strict=False):
                state, _ = dp.step(state, batch)
                ckpt.maybe_save(state, loader)
            ckpt.wait()
            assert ckpt._snapshots is not None
            ckpt._snapshots.wait()
            ckpt._close(remove_snapshots=False)
        live_lease(root / "ckpt")
        return {name: kind.file(root / "ckpt", root / "memory").read_bytes() for name, kind in KINDS.items()}


def cases():
    for kind_name, intact in intact_files().items():
        for fault_name, fault in faults(kind_name, intact):
            yield pytest.param(kind_name, fault, id=f"{kind_name}: {fault_name}")


# ------------------------------------------------------------------ one case


def copy_of(base: Base, tmp_path: Path, monkeypatch) -> tuple[Path, Path | None]:
    directory = tmp_path / "ckpt"
    shutil.copytree(base.directory, directory)
    memory = None
    if base.memory is not None:
        memory = tmp_path / "memory"
        shutil.copytree(base.memory / snapshot._key(base.directory), memory / snapshot._key(directory))
        monkeypatch.setenv("JDDP_SNAPSHOT_DIR", str(memory))
    else:
        monkeypatch.delenv("JDDP_SNAPSHOT_DIR", raising=False)
    return directory, memory


@pytest.mark.parametrize(("kind_name", "fault"), list(cases()))
def test_a_damaged_file_is_set_aside_or_refused_by_name_never_a_raw_error(
    tmp_path, monkeypatch, bases, kind_name, fault
):
    kind = KINDS[kind_name]
    base = bases[kind.base]
    directory, memory = copy_of(base, tmp_path, monkeypatch)
    if kind_name == "lease":
        live_lease(directory)
    path = kind.file(directory, memory)
    fault(kind, path)
    names = {str(path), str(path.relative_to(directory)) if path.is_relative_to(directory) else path.name}
    _, fresh, loader = make()
    error, restored, ckpt = None, None, None
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            ckpt = jddp.Checkpointer(directory)
            restored = ckpt.restore_or_init(fresh, loader)
        except Exception as raised:  # judged below: named, or a raw error
            error = raised
        finally:
            if ckpt is not None:
                ckpt._close(remove_snapshots=False)
    warned = [str(w.message) for w in said if issubclass(w.category, jddp.CheckpointWarning)]
    others = [f"{w.category.__name__}: {w.message}" for w in said if not issubclass(w.category, jddp.CheckpointWarning)]
    assert not others, others
    if error is not None:  # refused: a jddp error naming the file
        assert isinstance(error, ValueError | jddp.CheckpointError), f"a raw error: {error!r}"
        assert any(n in str(error) for n in names), f"the error does not name {names}: {error}"
        assert not kind.at_open or isinstance(error, jddp.CheckpointLeaseError), error
        return
    assert not kind.at_open, f"a Checkpointer opened beside a live (damaged) lease: {warned}"
    assert ckpt is not None and restored is not None
    state, loader = restored
    step = int(state.step)
    if warned:  # set aside, named; the run goes on from what is left, bitwise
        assert any(any(n in w for n in names) for w in warned), f"no warning names {names}: {warned}"
        fallback = {"snapshot": DISK_STEP, "meta": 2, "loader": 2, "run file": DISK_STEP}[kind_name]
        assert step == fallback, (step, warned)
    else:  # a field the restore does not read: the intact restore
        assert step == (SNAPSHOT_STEP if kind_name == "snapshot" else DISK_STEP), step
    for got, want in zip(host(state), base.states[step], strict=True):
        assert got.tobytes() == want.tobytes()
    assert loader.get_state() == base.loaders[step]
