"""How much memory does each checkpoint save and each in-memory snapshot keep: one process, or a group?

Memory kept per checkpoint save and per in-memory snapshot: one process, or a group under ``jddp launch``.

    python -m benchmarks save_leak [--mode jddp] [--saves 3000] [--every 100] [--sync] [--direct]
                                   [--max-to-keep 3] [--trace DEPTH] [--tuned]
    python -m jddp.launch -n 2 -m benchmarks save_leak --mode jddp ...    # the same in a group of 2

The MNIST-1D MLP's state (40-256-256-10 with AdamW: about 1 MB), a ``DataParallel`` step then a save at every
step. ``--mode``:

* ``jddp``: ``jddp.Checkpointer(dir, save_every=1).maybe_save`` (async unless ``--sync``; ``--direct``: Orbax's
  save from the main thread, as in a group, not from the thread jddp hands it to in a single process);
* ``orbax``: Orbax's ``CheckpointManager`` directly, the options jddp gives it, the state and a JSON item per save
  (no jddp code in the save: tells jddp's own memory from Orbax's and TensorStore's);
* ``snapshots``: ``Checkpointer(save_every=None, snapshots=True, snapshot_every=1)``, a snapshot per step and no
  disk save, under a temporary ``$JDDP_SNAPSHOT_DIR`` in ``/dev/shm``;
* ``both``: a save and a snapshot at every step;
* ``allgather``, ``sync``, ``steps``: no save, but one ``process_allgather`` (jddp's agreements), one
  ``sync_global_devices`` with a new name (Orbax's barriers), or nothing, after each step: in a group, what its
  collectives keep.

Every ``--every`` saves (after waiting for the writes and a ``gc.collect()``) each process prints glibc's in-use
bytes (``mallinfo2``: ``uordblks + hblkhd``, every arena, less tracemalloc's own), the bytes glibc holds from the
system (``arena + hblkhd``), the resident set (``VmRSS``) and its parts by kind of mapping (``resident_by_kind``),
and with ``--trace`` Python's traced bytes (tracemalloc); at the end, the least-squares slopes in bytes per save
over the second half of the saves, and with ``--trace DEPTH`` the tracebacks (DEPTH frames) that grew most over
that half. In use flat while held and resident grow is the allocator's (fragmentation, pages touched for the first
time), not a leak. ``--tuned`` re-executes the script with ``jddp launch``'s allocator settings (``GLIBC_TUNABLES``,
``MALLOC_TUNABLES``, as ``jddp launch`` sets it), which a group under ``jddp launch`` has already.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import itertools
import os
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import harness

# The GLIBC_TUNABLES jddp launch gives its processes (jddp/cli/launch/environment.py), for --tuned alone
MALLOC_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=17179869184"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def malloc_bytes() -> tuple[int, int]:
    """glibc's bytes in use (allocated chunks of every arena plus mmapped ones, less tracemalloc's own) and bytes
    held from the system (arenas plus mmapped chunks); zeros where mallinfo2 is missing."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2"):
        return 0, 0
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd) - tracemalloc.get_tracemalloc_memory(), int(info.arena + info.hblkhd)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def resident_by_kind() -> dict[str, int]:
    """Resident bytes by kind of mapping (``/proc/self/smaps``): glibc's ``heap`` (brk), ``stacks`` (anonymous
    read-write mappings of the default 8 MiB thread stack size), other ``anon`` mappings (pymalloc's arenas, mmap'd
    chunks, other allocators'), and ``files``."""
    kinds = {"heap": 0, "stacks": 0, "anon": 0, "files": 0}
    kind = "anon"
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:
            start, end = (int(a, 16) for a in head[0].split("-"))
            path = head[5] if len(head) > 5 else ""
            if path == "[heap]":
                kind = "heap"
            elif path and not path.startswith("["):
                kind = "files"
            elif abs(end - start - 8 * 2**20) <= 2**16 and head[1].startswith("rw"):
                kind = "stacks"
            else:
                kind = "anon"
        elif head[0] == "Rss:":
            kinds[kind] += int(head[1]) * 1024
    return kinds


def slope(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of ``(save, bytes)`` points: bytes per save."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else float("nan")


def mlp_state(dp):
    import numpy as np

    rng = np.random.default_rng(0)
    sizes = [40, 256, 256, 10]
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        params[f"w{i}"] = (rng.normal(size=(a, b)) / np.sqrt(a)).astype(np.float32)
        params[f"b{i}"] = np.zeros(b, np.float32)
    return dp.init(params, rng=0)


QUICK: dict[str, Any] = {"saves": 40, "warm_up": 5, "every": 20}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--mode", choices=("jddp", "orbax", "snapshots", "both", "allgather", "sync", "steps"), default="jddp"
    )
    parser.add_argument("--saves", type=int, default=3000, help="saves (or snapshots) measured, after --warm-up")
    parser.add_argument("--warm-up", type=int, default=100)
    parser.add_argument("--every", type=int, default=100, help="saves between measurements")
    parser.add_argument("--sync", action="store_true", help="synchronous saves (async_save=False)")
    parser.add_argument("--max-to-keep", type=int, default=3)
    parser.add_argument("--trace", type=int, default=0, metavar="DEPTH", help="tracemalloc with DEPTH frames")
    parser.add_argument("--top", type=int, default=12, help="tracebacks shown with --trace")
    parser.add_argument(
        "--direct", action="store_true", help="jddp: Orbax's save from the main thread (as with several processes)"
    )
    parser.add_argument("--tuned", action="store_true", help="jddp launch's GLIBC_TUNABLES")
    parser.add_argument("--trim-every", type=int, default=0, help="malloc_trim(0) every N saves (0: never)")
    return parser


def bench(args: argparse.Namespace) -> Any:
    if args.saves < 2 * args.every or args.every < 1 or args.warm_up < 0:
        get_args_parser().error(f"--saves must be >= 2 x --every, --every >= 1, --warm-up >= 0; got {vars(args)}")
    if args.tuned and "GLIBC_TUNABLES" not in os.environ:  # glibc reads it at the process's start only
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                  {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES})  # fmt: skip

    import jax

    import jddp

    jddp.initialize()  # under jddp launch: the group (Orbax then syncs the processes at every save); alone, nothing
    with (
        tempfile.TemporaryDirectory() as disk,
        tempfile.TemporaryDirectory(prefix="save-leak-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm,
    ):
        os.environ["JDDP_SNAPSHOT_DIR"] = shm
        directory = Path(disk) / "ckpt"
        if jax.process_count() > 1:  # one directory for the group, named after its coordinator's port
            port = os.environ.get("JDDP_COORDINATOR", "x:0").rsplit(":", 1)[1]
            directory = Path(tempfile.gettempdir()) / f"save-leak-{port}" / "ckpt"
        try:
            run(args, directory)
        finally:
            if jax.process_count() > 1 and jax.process_index() == 0:
                shutil.rmtree(directory.parent, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


def run(args, directory: Path) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    import jddp

    mesh = jddp.data_mesh(jax.devices()[:1] if jax.process_count() == 1 else None)

    def loss_fn(params, model_state, batch, key):
        h = batch["x"]
        for i in range(3):
            h = h @ params[f"w{i}"] + params[f"b{i}"]
            h = jax.nn.relu(h) if i < 2 else h
        return jnp.mean(h**2), (model_state, {})

    dp = jddp.DataParallel(loss_fn, optax.adamw(1e-3), mesh=mesh)
    state = mlp_state(dp)
    import numpy as np

    batch = {"x": np.random.default_rng(1).normal(size=(128, 40)).astype(np.float32)}
    if jax.process_count() > 1:  # each process's half of the global batch
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names))
        half = len(batch["x"]) // jax.process_count()
        local = batch["x"][jax.process_index() * half : (jax.process_index() + 1) * half]
        batch = {"x": jax.make_array_from_process_local_data(sharding, local)}
    load = os.getloadavg()
    me = f"[{jax.process_index()}] " if jax.process_count() > 1 else ""
    print(
        f"{me}save_leak: mode {args.mode}, {'sync' if args.sync else 'async'}, max_to_keep {args.max_to_keep}, "
        f"{args.warm_up} + {args.saves} saves, GLIBC_TUNABLES {os.environ.get('GLIBC_TUNABLES', '(unset)')}; "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        flush=True,
    )

    with contextlib.ExitStack() as stack:
        if args.mode == "orbax":
            save, wait = orbax_saver(args, directory, stack)
        elif args.mode in ("allgather", "sync", "steps"):  # the collectives a save makes in a group, or none
            from jax.experimental import multihost_utils

            def save(state, step):
                if args.mode == "steps":
                    return
                if args.mode == "sync":
                    multihost_utils.sync_global_devices(f"save_leak_{step}")  # Orbax's barriers: a unique name each
                else:
                    multihost_utils.process_allgather(np.asarray([step], np.int32))  # jddp's agreements

            def wait():
                pass
        else:
            ckpt = stack.enter_context(
                jddp.Checkpointer(
                    directory,
                    save_every=None if args.mode == "snapshots" else 1,
                    max_to_keep=args.max_to_keep,
                    async_save=not args.sync,
                    snapshots=args.mode in ("snapshots", "both"),
                    snapshot_every=1 if args.mode in ("snapshots", "both") else None,
                )
            )

            if args.direct and ckpt._writer is not None:  # alone, jddp hands Orbax's save to a thread of its own
                ckpt._writer.shutdown()
                ckpt._writer = None

            def save(state, step):
                ckpt.maybe_save(state)

            def wait():
                ckpt.wait()
                if ckpt._snapshots is not None:
                    ckpt._snapshots.wait()

        trims: list[float] = []

        def steps(count, start):
            nonlocal state
            for i in range(count):
                state, _ = dp.step(state, batch)
                save(state, start + i)
                if args.trim_every and (start + i) % args.trim_every == 0:
                    t0 = time.perf_counter()
                    ctypes.CDLL(None).malloc_trim(0)
                    trims.append(time.perf_counter() - t0)
            wait()
            gc.collect()

        steps(args.warm_up, 1)
        rows = []
        half = None
        if args.trace:
            tracemalloc.start(args.trace)
        begin = time.perf_counter()
        done = 0
        while done < args.saves:
            steps(args.every, args.warm_up + 1 + done)
            done += args.every
            used, held = malloc_bytes()
            kinds = resident_by_kind()
            row = (done, used, rss(), tracemalloc.get_traced_memory()[0] if args.trace else 0, held, kinds)
            rows.append(row)
            print(
                f"{me}  {done:6d} saves: in use {row[1] / 2**20:8.3f} MB, held {held / 2**20:8.3f} MB, "
                f"RSS {row[2] / 2**20:8.3f} MB ("
                + ", ".join(f"{k} {v / 2**20:.2f}" for k, v in kinds.items())
                + ")"
                + (f", traced {row[3] / 2**20:7.3f} MB" if args.trace else "")
                + f" ({(time.perf_counter() - begin) / done * 1000:.1f} ms a save)",
                flush=True,
            )
            if args.trace and half is None and done >= args.saves // 2:
                half = (done, take_snapshot())
        after = take_snapshot() if args.trace else None
        if args.trace:
            tracemalloc.stop()
    late = [r for r in rows if r[0] >= args.saves // 2]
    load = os.getloadavg()
    print(
        f"{me}  bytes per save over saves {late[0][0]} to {late[-1][0]}: "
        f"in use {slope([(r[0], r[1]) for r in late]):+.0f}, "
        f"held {slope([(r[0], r[4]) for r in late]):+.0f}, RSS {slope([(r[0], r[2]) for r in late]):+.0f}"
        + (f", traced {slope([(r[0], r[3]) for r in late]):+.0f}" if args.trace else "")
        + "".join(f", {k} {slope([(r[0], r[5][k]) for r in late]):+.0f}" for k in late[0][5])
        + f"; load at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    if trims:
        trims.sort()
        print(
            f"{me}  malloc_trim(0): {len(trims)} calls, median {trims[len(trims) // 2] * 1e3:.2f} ms, "
            f"max {trims[-1] * 1e3:.2f} ms"
        )
    if half is not None and after is not None:
        count = rows[-1][0] - half[0]
        grown = after.compare_to(half[1], "traceback")
        print(f"  tracemalloc, grown over the last {count} saves (bytes per save, blocks), by traceback:")
        for stat in grown[: args.top]:
            frames = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in stat.traceback)
            print(f"    {stat.size_diff / count:+8.1f} B {stat.count_diff:+6d}  {frames}")


def take_snapshot() -> tracemalloc.Snapshot:
    gc.collect()
    return tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])


def orbax_saver(args, directory: Path, stack: contextlib.ExitStack):
    """Orbax's manager alone: jddp's options, a StandardSave of the state and a JsonSave per step."""
    import orbax.checkpoint as ocp

    from jddp.checkpoint import restore

    options = ocp.CheckpointManagerOptions(
        max_to_keep=args.max_to_keep,
        create=True,
        cleanup_tmp_directories=True,
        save_interval_steps=1,
        enable_async_checkpointing=not args.sync,
        async_options=ocp.AsyncOptions(timeout_secs=600),
    )
    handlers = {"state": ocp.StandardCheckpointHandler(), "loader": ocp.JsonCheckpointHandler()}
    manager = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
    stack.callback(manager.close)

    def save(state, step):
        import jax
        import jax.numpy as jnp

        tree = jax.tree.map(jnp.copy, restore.as_dict(state))  # the next step donates the state, not a copy
        items = {"state": ocp.args.StandardSave(tree), "loader": ocp.args.JsonSave({"step": step, "epoch": 0})}
        manager.save(step, args=ocp.args.Composite(**items), force=True)

    return save, manager.wait_until_finished


if __name__ == "__main__":
    main()
