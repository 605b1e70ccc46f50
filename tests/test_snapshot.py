"""In-memory snapshots (jddp.checkpoint.snapshot): restored bitwise as the disk restores, never torn, never damaged.

Each guarantee is checked over generated cases: every point at which a kill can cut a write, every byte that damage
can hit, every choice of steps the processes can hold.
"""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jddp
from jddp.checkpoint import snapshot
from jddp.checkpoint.restore import as_dict

rng = np.random.default_rng(0)
SOURCE = {"x": rng.normal(size=(96, 8)).astype(np.float32), "y": rng.integers(0, 3, 96).astype(np.int32)}


def loss_fn(params, model_state, batch, key):
    h = jnp.tanh(batch["x"] @ params["w"].astype(jnp.float32))
    logits = h @ params["v"]
    loss = jddp.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]), batch.get("mask"))
    new_state = {
        "count": model_state["count"] + 1,
        "flag": ~model_state["flag"],
        "ema": (model_state["ema"] * 0.9 + h[0, :4].astype(jnp.bfloat16) * 0.1).astype(jnp.bfloat16),
        "small": model_state["small"] + jnp.int8(3),
    }
    return loss, (new_state, {})


def make(devices: int, shard_optimizer: bool):
    mesh = jddp.data_mesh(jax.devices()[:devices])
    dp = jddp.DataParallel(loss_fn, optax.adamw(1e-2), mesh=mesh, shard_optimizer=shard_optimizer)
    init = np.random.default_rng(1)
    params = {
        "w": (init.normal(size=(8, 16)) * 0.3).astype(jnp.bfloat16),  # a bfloat16 leaf: bytes, not values
        "v": (init.normal(size=(16, 3)) * 0.3).astype(np.float32),
    }
    model_state = {
        "count": np.zeros((), np.int32),
        "flag": np.array([True, False, True]),
        "ema": np.zeros(4, jnp.bfloat16),
        "small": np.zeros(2, np.int8),
    }
    state = dp.init(params, model_state, rng=3)
    loader = jddp.data.DataLoader(SOURCE, global_batch_size=16, seed=2, mesh=mesh)
    return dp, state, loader


def host(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(as_dict(state))]


def assert_bitwise(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


@pytest.fixture
def snapshot_dir(tmp_path, monkeypatch):
    path = tmp_path / "memory"
    monkeypatch.setenv("JDDP_SNAPSHOT_DIR", str(path))
    return path


@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["replicated", "zero1"])
def test_a_memory_restore_is_bitwise_the_disk_restore_of_the_same_step(tmp_path, snapshot_dir, shard_optimizer):
    """Six steps, a disk save and a snapshot at step 6: restored from memory (and again with snapshots off, from the
    disk, through Orbax: the independent reference), the states, data positions and extra states agree bit for bit,
    on every dtype the state holds (bfloat16, bool, int8, int32, uint32, float32)."""
    dp, state, loader = make(4, shard_optimizer)
    extra = Extra()
    with jddp.Checkpointer(tmp_path / "ckpt", save_every=6, snapshot_every=3) as ckpt:
        for _, batch in zip(range(6), loader, strict=False):
            state, _ = dp.step(state, batch)
            extra.value += 1
            ckpt.maybe_save(state, loader, extra=extra)
        ckpt._snapshots.wait()
        assert ckpt._snapshots.steps() == [6, 3]
        ckpt._close(remove_snapshots=False)  # as after a crash: the snapshots stay
    trained, position = host(state), loader.get_state()

    restored = {}
    for source, snapshots in (("memory", None), ("disk", False)):
        _, fresh, fresh_loader = make(4, shard_optimizer)
        got_extra = Extra()
        ckpt = jddp.Checkpointer(tmp_path / "ckpt", snapshots=snapshots)
        got, fresh_loader = ckpt.restore_or_init(fresh, fresh_loader, extra=got_extra)
        assert ckpt.restored_from == source
        assert int(got.step) == 6 and got_extra.value == 6
        assert fresh_loader.get_state() == position
        restored[source] = host(got)
        for a, b in zip(jax.tree.leaves(as_dict(got)), jax.tree.leaves(as_dict(fresh)), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)  # into the shardings of the state passed in
        ckpt._close(remove_snapshots=False)
    assert_bitwise(restored["memory"], trained)
    assert_bitwise(restored["memory"], restored["disk"])


class Extra:
    def __init__(self) -> None:
        self.value = 0

    def get_state(self):
        return {"value": self.value}

    def set_state(self, state) -> None:
        self.value = state["value"]


def tree_at(step: int) -> dict:
    """A state whose every byte says its step (and the leaf)."""
    return {
        "a": jnp.full((64, 33), step, jnp.float32),
        "b": jnp.full((5,), step % 2 == 0),
        "c": jnp.full((3, 7), step * 7, jnp.int32).astype(jnp.bfloat16),
        "d": jnp.asarray(step, jnp.int32),
    }


def expected_bytes(step: int) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree_at(step))]


class Killed(Exception):
    """Where a SIGKILL would have stopped the writer."""


class CutOs:
    """``os`` as the snapshot writer sees it, stopped at its ``cut``-th file-system call (a pwrite cut halfway
    writes half of its bytes first); ``cut=None`` counts the calls."""

    CALLS = ("replace", "open", "ftruncate", "pwrite", "close", "unlink")

    def __init__(self, cut: int | None, half: bool = False) -> None:
        self.cut, self.half, self.calls = cut, half, 0

    def __getattr__(self, name):
        real = getattr(os, name)
        if name not in self.CALLS:
            return real

        def call(*args):
            if self.cut is not None and self.calls == self.cut:
                if name == "pwrite" and self.half:
                    fd, data, offset = args
                    os.pwrite(fd, bytes(data)[: len(data) // 2], offset)
                if name != "close":  # a killed process's files are closed by the kernel all the same
                    raise Killed(f"{name} #{self.calls}")
            self.calls += 1
            return real(*args)

        return call


def write(snaps: snapshot.Snapshots, step: int) -> None:
    tree = tree_at(step)
    snaps.take(step, tree, {"position": step}, None)
    snaps.wait()


def test_a_kill_at_any_point_of_a_write_leaves_the_complete_snapshots_and_no_torn_one(tmp_path, monkeypatch):
    """Every file-system call of a snapshot's write (and every pwrite cut halfway) is, in turn, where the writer
    dies: a process started afterwards lists only complete snapshots, each loads and holds its own step's bytes,
    and the newest complete one before the cut is among them."""
    directory = tmp_path / "ckpt"
    counting = CutOs(None)
    snaps = snapshot.Snapshots(tmp_path / "count", directory, fingerprint=None, budget=0.01)
    for step in (1, 2, 3):
        write(snaps, step)
    before = counting.calls
    monkeypatch.setattr(snapshot, "os", counting)
    write(snaps, 4)
    monkeypatch.undo()
    calls = counting.calls - before
    assert calls >= 6, calls  # replace, open, ftruncate, pwrite x2, close, replace, replace (retention)
    cuts = [(cut, half) for cut in range(calls) for half in (False, True)]
    for cut, half in cuts:
        base = tmp_path / f"cut-{cut}-{half}"
        snaps = snapshot.Snapshots(base, directory, fingerprint=None, budget=0.01)
        for step in (1, 2, 3):
            write(snaps, step)
        monkeypatch.setattr(snapshot, "os", CutOs(cut, half))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the failed write's warning
            write(snaps, 4)
        monkeypatch.undo()
        snaps.close(remove=False)
        again = snapshot.Snapshots(base, directory, fingerprint=None, budget=0.01)  # the restarted process
        steps = again.steps()
        assert 3 in steps or 4 in steps, (cut, half, steps)
        assert steps and max(steps) >= 3, (cut, half, steps)
        for step in steps:
            tree, loader, _ = again.load(step, tree_at(0), None)
            got = [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]
            assert got == expected_bytes(step), (cut, half, step)
            assert loader == {"position": step}
        assert not (again.folder / snapshot.WRITING).exists()


def test_damage_anywhere_in_a_snapshot_is_never_restored(tmp_path):
    """A byte flipped at positions drawn over the whole file (header and data): the load refuses it, or (a flip in
    the header's JSON spaces or a digit of a field it does not use) returns exactly the written bytes."""
    snaps = snapshot.Snapshots(tmp_path / "memory", tmp_path / "ckpt", fingerprint=None, budget=0.01)
    write(snaps, 5)
    path = snaps.folder / f"5{snapshot.SUFFIX}"
    original = path.read_bytes()
    positions = np.random.default_rng(4).choice(len(original), 60, replace=False)
    refused = 0
    for position in [*positions, len(original) - 1, 0, 9]:
        damaged = bytearray(original)
        damaged[position] ^= 0x10
        path.write_bytes(bytes(damaged))
        try:
            tree, _, _ = snaps.load(5, tree_at(0), None)
        except snapshot.Unusable:
            refused += 1
            continue
        assert [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)] == expected_bytes(5), position
    assert refused >= 55, refused  # the data is most of the file: nearly every flip is caught


def test_a_damaged_newest_snapshot_falls_back_to_the_older_one_then_the_disk(tmp_path, snapshot_dir):
    dp, state, loader = make(2, False)
    with jddp.Checkpointer(tmp_path / "ckpt", save_every=2, snapshot_every=1) as ckpt:
        for _, batch in zip(range(5), loader, strict=False):
            state, _ = dp.step(state, batch)
            ckpt.maybe_save(state, loader)
        ckpt._snapshots.wait()
        folder = ckpt._snapshots.folder
        ckpt._close(remove_snapshots=False)
    assert sorted(int(p.stem) for p in folder.glob("*.snap")) == [4, 5]
    for damaged, expected, source in ((5, 4, "memory"), (4, 4, "disk")):
        path = folder / f"{damaged}{snapshot.SUFFIX}"
        data = bytearray(path.read_bytes())
        data[-3] ^= 1
        path.write_bytes(bytes(data))
        _, fresh, fresh_loader = make(2, False)
        ckpt = jddp.Checkpointer(tmp_path / "ckpt")
        with pytest.warns(jddp.CheckpointWarning, match=f"in-memory snapshot of step {damaged} cannot be used"):
            got, _ = ckpt.restore_or_init(fresh, fresh_loader)
        assert (int(got.step), ckpt.restored_from) == (expected, source)
        ckpt._close(remove_snapshots=False)


def test_a_sharded_snapshot_is_not_restored_onto_another_device_count_the_disk_is(tmp_path, snapshot_dir):
    """ZeRO-1's optimizer state split over 4 devices: a process restarted on 2 finds no shard of its split, and
    restores the disk's step (Orbax reshards) without a word about damage."""
    dp, state, loader = make(4, True)
    with jddp.Checkpointer(tmp_path / "ckpt", save_every=3, snapshot_every=1) as ckpt:
        for _, batch in zip(range(4), loader, strict=False):
            state, _ = dp.step(state, batch)
            ckpt.maybe_save(state, loader)
        ckpt._close(remove_snapshots=False)
    _, fresh, fresh_loader = make(2, True)
    ckpt = jddp.Checkpointer(tmp_path / "ckpt")
    with pytest.warns(jddp.CheckpointWarning, match="lacks the shard"):
        got, _ = ckpt.restore_or_init(fresh, fresh_loader)
    assert (int(got.step), ckpt.restored_from) == (3, "disk")
    ckpt.close()


@pytest.mark.parametrize("shard_optimizer", [False, True], ids=["replicated", "zero1"])
def test_another_process_counts_snapshot_restores_a_new_group_from_memory_then_is_removed(
    tmp_path, snapshot_dir, shard_optimizer
):
    """What an elastic run's next round finds (jddp launch --nnodes MIN:MAX): no snapshot of its own process
    count, the newer one a group of another count left on the host (here process 1 of 3). Whole leaves restore from
    it onto 2 devices, bitwise the state trained; ZeRO-1's split ones cannot, and the disk's step is restored, named.
    Either way the other count's folder is gone after the restore: it holds the round before's timeline."""
    dp, state, loader = make(4, shard_optimizer)
    with jddp.Checkpointer(tmp_path / "ckpt", save_every=3, snapshot_every=1) as ckpt:
        for _, batch in zip(range(5), loader, strict=False):
            state, _ = dp.step(state, batch)
            ckpt.maybe_save(state, loader)
        ckpt._snapshots.wait()
        folder = ckpt._snapshots.folder
        ckpt._close(remove_snapshots=False)
    trained, position = host(state), loader.get_state()
    left = folder.parent / "process-1-of-3"
    folder.rename(left)
    _, fresh, fresh_loader = make(2, shard_optimizer)
    ckpt = jddp.Checkpointer(tmp_path / "ckpt")
    if shard_optimizer:
        with pytest.warns(jddp.CheckpointWarning, match="parts of split leaves"):
            got, fresh_loader = ckpt.restore_or_init(fresh, fresh_loader)
        assert (int(got.step), ckpt.restored_from) == (3, "disk")
    else:
        got, fresh_loader = ckpt.restore_or_init(fresh, fresh_loader)
        assert (int(got.step), ckpt.restored_from) == (5, "peer")
        assert fresh_loader.get_state() == position
        assert_bitwise(host(got), trained)
        for a, b in zip(jax.tree.leaves(as_dict(got)), jax.tree.leaves(as_dict(fresh)), strict=True):
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert not left.exists()
    ckpt.close()


def test_a_config_fingerprint_given_by_fit_reaches_the_snapshots_and_a_restart_restores_from_memory(
    tmp_path, snapshot_dir
):
    """``jddp.fit(config=...)`` fingerprints a Checkpointer made without a config (``jddp.loop._fingerprint``, what
    fit calls). The snapshots must carry that fingerprint: they once kept the empty one of the Checkpointer's
    construction, no snapshot matched the restarted process's, and every restart of such a run went to disk."""
    from jddp import loop

    config = {"lr": 0.01}
    dp, state, loader = make(4, False)
    ckpt = jddp.Checkpointer(tmp_path / "ckpt", save_every=3, snapshot_every=1)
    loop._fingerprint(ckpt, config)
    for _, batch in zip(range(4), loader, strict=False):
        state, _ = dp.step(state, batch)
        ckpt.maybe_save(state, loader)
    ckpt._snapshots.wait()
    ckpt._close(remove_snapshots=False)  # as after a crash
    _, fresh, fresh_loader = make(4, False)
    again = jddp.Checkpointer(tmp_path / "ckpt")
    loop._fingerprint(again, config)
    got, _ = again.restore_or_init(fresh, fresh_loader)
    assert (int(got.step), again.restored_from) == (4, "memory")
    assert_bitwise(host(got), host(state))
    again.close()


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-1, 12), st.lists(st.integers(0, 12), max_size=2 * snapshot.KEEP, unique=True)),
        min_size=1,
        max_size=5,
    )
)
def test_the_steps_tried_are_those_every_process_holds_not_older_than_any_disk_step(processes):
    rows = np.full((len(processes), 1 + 2 * snapshot.KEEP), -1)
    for row, (disk, held) in zip(rows, processes, strict=True):
        row[0] = disk
        row[1 : 1 + len(held)] = held
    newest_disk = max(disk for disk, _ in processes)
    expected = [
        s for s in range(12, -1, -1) if all(s in held for _, held in processes) and s >= newest_disk
    ]  # brute force
    assert snapshot.choose(rows) == expected


def test_closing_after_the_run_removes_the_snapshots_an_error_keeps_them(tmp_path, snapshot_dir):
    dp, state, loader = make(1, False)
    for fails in (False, True):
        with pytest.raises(RuntimeError) if fails else _nothing():
            with jddp.Checkpointer(tmp_path / f"ckpt-{fails}", snapshot_every=1) as ckpt:
                for _, batch in zip(range(2), loader, strict=False):
                    state, _ = dp.step(state, batch)
                    ckpt.maybe_save(state, loader)
                folder = ckpt._snapshots.folder
                if fails:
                    raise RuntimeError("a bug in the training loop")
        assert folder.exists() == fails, fails


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.multiprocess  # starts a process of its own
def test_a_real_sigkill_during_writes_leaves_complete_snapshots_only(tmp_path):
    """A process writing 16 MB snapshots is SIGKILLed in the middle of a pwrite (its writer pauses there: the test
    kills it then), after a drawn number of writes: its half-written file is there and never listed, and every
    snapshot it lists loads with its own step's values."""
    import signal
    import subprocess
    import sys

    from tests import multiprocess

    for i, halves in enumerate(np.random.default_rng(7).integers(1, 9, 3)):
        base = tmp_path / f"kill-{i}"
        child = subprocess.Popen(
            [sys.executable, str(multiprocess.WORKERS / "snapshot_writer.py"), str(base)],
            env=multiprocess.environment(),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        for _ in range(halves):
            assert child.stdout.readline().strip() == "HALF"
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        folder = next(base.glob("*/process-0-of-1"))
        assert (folder / snapshot.WRITING).exists()  # killed mid-write: the torn file is there
        again = snapshot.Snapshots(base, "killed-writer", fingerprint=None, budget=0.01)
        steps = again.steps()
        # two pwrites a snapshot (its header, its data): those before the cut one are complete
        assert len(steps) == min((halves - 1) // 2, snapshot.KEEP), (halves, steps)
        template = {"a": jnp.zeros((2048, 2048), jnp.float32), "b": jnp.zeros((1024,), jnp.int32)}
        for step in steps:
            tree, loader, _ = again.load(step, template, None)
            assert loader == {"position": step}
            assert int(tree["a"].min()) == int(tree["a"].max()) == step and int(tree["b"][-1]) == step
        again.close(remove=True)


class Counted:
    """A pytree node that counts its flattenings (an NNX state's nodes flatten in Python, slowly)."""

    flattened = 0

    def __init__(self, children: dict) -> None:
        self.children = children


def _flatten_counted(node: Counted):
    Counted.flattened += 1
    return (node.children,), None


jax.tree_util.register_pytree_node(Counted, _flatten_counted, lambda _, children: Counted(children[0]))


def test_a_snapshot_flattens_the_state_once_and_its_reused_layout_restores_every_kind_of_leaf_bitwise(tmp_path):
    """Snapshots of one structure at three steps (the first builds the layout, the others reuse it): each later one
    flattens the state once, and each restores bit for bit, against the arrays' own bytes, a typed PRNG key, a leaf
    split over 2 devices, one replicated over them, one on a single device, bool and bfloat16."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def state(step: int) -> dict:
        values = np.random.default_rng(step).normal(size=(8, 3)).astype(np.float32)
        return {
            "key": jax.device_put(jax.random.key(step), replicated),
            "nested": Counted(
                {
                    "split": jax.device_put(values, split),
                    "replicated": jax.device_put(values.astype(jnp.bfloat16), replicated),
                    "flag": jax.device_put(values[:, 0] > 0, replicated),
                }
            ),
            "one_device": jnp.asarray(values[0] * step),
        }

    def raw(tree: dict) -> list[bytes]:
        leaves = jax.tree.leaves(tree)
        return [
            np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x).tobytes()
            for x in leaves
        ]

    snaps = snapshot.Snapshots(tmp_path / "memory", tmp_path / "ckpt", fingerprint=None, budget=0.01, every=1)
    flattened, written = [], {}
    for step in (1, 2, 3):
        tree = state(step)
        before = Counted.flattened
        snaps.take(step, tree, {"position": step}, None)
        flattened.append(Counted.flattened - before)
        snaps.wait()
        written[step] = raw(tree)
    assert flattened[1:] == [1, 1], flattened  # the first also builds the layout
    assert len(snaps._layouts) == 1
    template = state(0)
    for step in (2, 3):
        tree, loader, _ = snaps.load(step, template, None)
        assert loader == {"position": step}
        assert raw(tree) == written[step], step
        for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(template), strict=True):
            assert got.dtype == want.dtype and got.sharding == want.sharding
    snaps.close(remove=True)


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_a_state_of_the_same_structure_with_another_shape_or_dtype_gets_its_own_layout(tmp_path, change):
    """The layout cache is keyed by what a layout is made of: the tree, and each leaf's shape, dtype and sharding. A
    state whose leaves keep their structure and sharding but change shape (a buffer that grows) or dtype (a cast)
    must not be written with the previous layout's sizes."""
    snaps = snapshot.Snapshots(tmp_path / "memory", tmp_path / "ckpt", fingerprint=None, budget=0.01, every=1)
    first = {"w": jnp.arange(6, dtype=jnp.float32)}
    second = {"w": jnp.arange(10, dtype=jnp.float32) if change == "shape" else jnp.arange(6, dtype=jnp.int32)}
    for step, tree in ((1, first), (2, second)):
        snaps.take(step, tree, {"position": step}, None)
        snaps.wait()
    restored, _, _ = snaps.load(2, second, None)
    assert restored["w"].dtype == second["w"].dtype
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(second["w"]))
    snaps.close(remove=True)


class DeviceBuffer:
    """A packed snapshot buffer as it is on an accelerator: in device memory, copied to the host when asked."""

    def __init__(self, buffer, started: list) -> None:
        self.buffer, self.started = buffer, started

    def devices(self):
        return {type("Device", (), {"platform": "cuda"})()}

    def copy_to_host_async(self) -> None:
        self.started.append(True)

    def __array__(self, dtype=None, copy=None):
        assert self.started, "the writer read a device buffer whose copy to the host was never started"
        return np.asarray(self.buffer)


def test_on_an_accelerator_the_copy_to_host_starts_at_the_snapshot_and_the_file_is_the_same(tmp_path, monkeypatch):
    """The buffer of a device's shards is copied to the host asynchronously from the main thread (started where
    the snapshot is taken, waited for by the writer thread); on CPU nothing is copied (a view). The file is the
    same either way."""
    snaps = snapshot.Snapshots(tmp_path / "cpu", tmp_path / "ck1", fingerprint=None, budget=0.01)
    write(snaps, 3)
    on_cpu = data_of(snaps.folder / f"3{snapshot.SUFFIX}")
    started: list = []
    pack = snapshot.snapshot_format.pack
    monkeypatch.setattr(snapshot.snapshot_format, "pack", lambda parts: DeviceBuffer(pack(parts), started))
    snaps = snapshot.Snapshots(tmp_path / "gpu", tmp_path / "ck2", fingerprint=None, budget=0.01)
    write(snaps, 3)
    assert started and data_of(snaps.folder / f"3{snapshot.SUFFIX}") == on_cpu


def data_of(path) -> bytes:
    """A snapshot file's bytes after its header (which holds the time it was written)."""
    raw = path.read_bytes()
    header = snapshot.snapshot_format.HEADER_LENGTH
    return raw[header.size + header.unpack_from(raw)[0] :]
