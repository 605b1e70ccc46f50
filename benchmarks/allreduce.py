"""What bus bandwidth does jddp's all-reduce reach between 2 processes, against PyTorch gloo, memcpy and TCP?

All-reduce bus bandwidth between 2 processes: jddp's path against PyTorch gloo, with memcpy and TCP ceilings.

Two processes are started through ``jddp launch`` (one CPU device each). In
both, for each message size (float32, 4 KiB to 64 MiB by default), these run
interleaved, round by round in alternating order:

* ``jax``: jddp's path, a jitted ``shard_map`` ``psum`` over the 2-device
  ``data`` mesh (gloo, as ``jddp.initialize`` selects), waited for per call;
* ``torch``: ``torch.distributed.all_reduce`` with gloo on a tensor of the same size;
* ``tcp``: both processes send the message to each other over one loopback
  TCP connection at the same time (what a 2-rank ring all-reduce moves:
  half in the reduce-scatter, half in the all-gather, both ways at once);
* ``memcpy``: ``np.copyto`` of the message in one process;
* ``mpi`` (with ``--transport mpi``; the group then runs under ``jddp launch
  --transport mpi``, the ``jddp[mpi]`` extra): jddp's MPI path, the same
  ``shard_map`` with ``jddp.engine.mpi.mpi_psum`` (``MPI_Allreduce``).

Bus bandwidth is size / time x 2(n-1)/n (NCCL's busbw), which for n = 2 is
size / time, so all four columns compare directly: ``tcp`` and ``memcpy`` are
ceilings. Medians over ``--rounds`` of per-call times. ``--malloc both`` (the
default) runs the group twice: with the glibc settings ``jddp launch`` gives
its workers and with glibc's defaults (``--no-malloc-tuning``), one after the other.

    python -m benchmarks allreduce --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from jddp import net

KIB = 1024
DEFAULT_SIZES = ",".join(str(4**i * 4 * KIB) for i in range(8))  # 4 KiB .. 64 MiB
VARIANTS = ("jax", "torch", "tcp", "memcpy")

QUICK: dict[str, Any] = {"sizes": "4096,65536", "rounds": 2, "bytes_per_round": 8388608}  # --quick: a tiny size


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes in bytes (default 4 KiB .. 64 MiB)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size (default 5)")
    p.add_argument("--bytes-per-round", type=int, default=128 << 20, help="traffic per variant and round (128 MiB)")
    p.add_argument("--malloc", choices=("both", "tuned", "default"), default="both", help="glibc settings to run")
    p.add_argument("--transport", choices=("xla", "mpi"), default="xla", help="mpi: add the mpi column (jddp[mpi])")
    return p


def _run_group(args: argparse.Namespace, tuned: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "allreduce.json")
        cmd = [sys.executable, "-m", "jddp.launch", "--peer-timeout", "120", "-n", "2"]
        cmd += ["--transport", "mpi"] if args.transport == "mpi" else ["--devices-per-process", "1"]
        cmd += [] if tuned else ["--no-malloc-tuning"]
        cmd += ["-m", "benchmarks.allreduce", "--worker", out, str(net.free_port()), str(net.free_port())]
        cmd += [args.sizes, str(args.rounds), str(args.bytes_per_round)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("JDDP_")}  # XLA_FLAGS pass through
        env.pop("GLIBC_TUNABLES", None)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"the 2-process group failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        with open(out) as f:
            return json.load(f)


def _size(n: int) -> str:
    return f"{n // (1 << 20)} MiB" if n >= 1 << 20 else f"{n // KIB} KiB"


def bench(args: argparse.Namespace) -> Any:
    runs = {"tuned": [True], "default": [False], "both": [True, False]}[args.malloc]
    results = {("tuned" if t else "default"): _run_group(args, t) for t in runs}
    print(f"all-reduce bus bandwidth between 2 processes (GB/s = 1e9 B/s), median of {args.rounds} rounds")
    for name, rows in results.items():
        print(f"glibc malloc: {name}{' (jddp launch)' if name == 'tuned' else ' (--no-malloc-tuning)'}")
        variants = [v for v in (*VARIANTS, "mpi") if v in rows[0]]
        mpi = "mpi" in variants
        print(f"{'size':>8}" + "".join(f"{v:>9}" for v in variants) + f"{'jax/torch':>11}"
              + (f"{'mpi/torch':>11}" if mpi else "") + f"{'jax us':>9}{'torch us':>9}")  # fmt: skip
        for r in rows:
            bw = "".join(f"{r[v]['gbps']:>9.2f}" for v in variants)
            ratio = r["jax"]["gbps"] / r["torch"]["gbps"]
            mpi_ratio = f"{r['mpi']['gbps'] / r['torch']['gbps']:>11.2f}" if mpi else ""
            print(f"{_size(r['bytes']):>8}{bw}{ratio:>11.2f}{mpi_ratio}{r['jax']['us']:>9.0f}{r['torch']['us']:>9.0f}")
    return results


def main(argv: Sequence[str] | None = None) -> Any:
    return harness.run(__name__, __doc__, get_args_parser(), bench, argv, quick=QUICK)


# ----------------------------------------------------------------- worker


def _tcp_pair(rank: int, port: int) -> socket.socket:
    if rank == 0:
        with socket.create_server(("127.0.0.1", port)) as server:
            conn, _ = server.accept()
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port))
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


class _Duplex:
    """Full-duplex exchange over one TCP connection, the sending side on a long-lived thread (as gloo's pairs)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.todo, self.done = conn, queue.SimpleQueue(), queue.SimpleQueue()
        threading.Thread(target=self._send_forever, daemon=True).start()

    def _send_forever(self) -> None:
        while True:
            self.conn.sendall(self.todo.get())
            self.done.put(None)

    def exchange(self, send: memoryview, recv: memoryview) -> None:
        """Sends ``send`` and receives as many bytes at the same time."""
        self.todo.put(send)
        got = 0
        while got < len(recv):
            got += self.conn.recv_into(recv[got:])
        self.done.get()


def _calls(size: int, rank: int, psum, mesh, duplex: _Duplex, mpi_sum) -> tuple[dict, object]:
    """One call of each variant on a message of ``size`` bytes, and jax's input (rank 0 holds 1s, rank 1 2s)."""
    import jax
    import numpy as np
    import torch.distributed as dist
    from torch import from_numpy

    import jddp

    n = size // 4
    local = np.full(n, rank + 1.0, np.float32)
    x = jax.make_array_from_process_local_data(jddp.batch_sharding(mesh), local, (2 * n,))
    tensor, src, dst = from_numpy(local.copy()), np.ones(n, np.float32), np.empty(n, np.float32)
    send, recv = memoryview(np.ones(size, np.uint8)), memoryview(np.empty(size, np.uint8))
    calls = {
        "jax": lambda: psum(x).block_until_ready(),
        "torch": lambda: dist.all_reduce(tensor),
        "tcp": lambda: duplex.exchange(send, recv),
        "memcpy": lambda: np.copyto(dst, src),
    }
    if mpi_sum is not None:
        calls["mpi"] = lambda: mpi_sum(x).block_until_ready()
    return calls, x


def _worker(out: str, torch_port: str, tcp_port: str, sizes: str, rounds: str, bytes_per_round: str) -> None:
    import jddp

    jddp.initialize(verbose=False)
    import jax
    import numpy as np
    import torch
    import torch.distributed as dist
    from jax import lax
    from jax.sharding import PartitionSpec as P

    rank = jax.process_index()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=2)
    conn = _tcp_pair(rank, int(tcp_port))
    duplex = _Duplex(conn)
    mesh = jddp.data_mesh()
    psum = jax.jit(jax.shard_map(lambda x: lax.psum(x, jddp.DATA_AXIS), mesh=mesh, in_specs=P("data"), out_specs=P()))
    mpi_sum = None
    if os.environ.get("JDDP_TRANSPORT") == "mpi":  # jddp launch --transport mpi
        from jddp.engine import mpi

        mpi.check(mesh.size)
        body = lambda x: mpi.mpi_psum(x, jddp.DATA_AXIS)
        mpi_sum = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
    variants = (*VARIANTS, "mpi") if mpi_sum is not None else VARIANTS
    rows = []
    for size in (int(s) for s in sizes.split(",")):
        iters = max(3, min(200, int(bytes_per_round) // size))
        calls, x = _calls(size, rank, psum, mesh, duplex, mpi_sum)
        for sum_of in (psum, mpi_sum) if mpi_sum is not None else (psum,):
            result = sum_of(x)  # compile; check the sum
            if not np.all(np.asarray(result.addressable_data(0)) == 3.0):
                raise AssertionError(f"the sum of 1 and 2 gave {np.asarray(result.addressable_data(0))[:4]}")
        times = {v: [] for v in variants}
        for r in range(rounds := int(rounds)):
            for name in variants if r % 2 == 0 else variants[::-1]:
                calls[name]()  # one untimed call: both processes enter the timed loop together
                start = time.perf_counter()
                for _ in range(iters):
                    calls[name]()
                times[name].append((time.perf_counter() - start) / iters)
        row = {"bytes": size, "iters": iters}
        for name, t in times.items():
            med = statistics.median(t)
            row[name] = {"us": med * 1e6, "gbps": size / med / 1e9, "runs_us": [v * 1e6 for v in t]}
        rows.append(row)
    dist.destroy_process_group()
    conn.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(*sys.argv[2:])
    else:
        main()
