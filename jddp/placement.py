"""Which devices each process of a host owns: the host's platform and accelerator inventory, read without JAX,
and the placement of the launcher's processes on them, as pure functions of that inventory.

``jddp launch`` runs on the host before any process starts and imports no JAX (a process that initialised the
backend would take accelerator memory), so the inventory is read the way the drivers publish it:

* ``cuda``: ``$CUDA_VISIBLE_DEVICES`` when set (the GPUs this launcher was given, by a scheduler or by hand), else
  one entry per GPU under ``/proc/driver/nvidia/gpus/``, else the ``/dev/nvidiaN`` device files;
* ``rocm``: ``$HIP_VISIBLE_DEVICES`` or ``$ROCR_VISIBLE_DEVICES``, else ``/dev/dri/renderD*`` where ``/dev/kfd`` is;
* ``tpu``: ``$TPU_VISIBLE_CHIPS``, else ``/dev/accelN`` (TPU v2 to v4) or ``/dev/vfio/N`` (v5e and later);
* ``cpu`` otherwise, or wherever ``$JAX_PLATFORMS`` names ``cpu`` first (the user asked for the CPU on a GPU host).

Placement (``jddp launch -n``; torchrun's ``--nproc-per-node``):

* ``-n device``: one process per local accelerator, each given its own through the driver's visibility variable
  (``CUDA_VISIBLE_DEVICES=3``, ``HIP_VISIBLE_DEVICES=3``). That, not ``jax.distributed.initialize``'s
  ``local_device_ids``, because the driver enforces it for everything the process does: user code that touches
  the backend before ``jddp.initialize``, a spare, a library that allocates first; no process can create a context
  on, or preallocate 75% of, another's GPU. Inside the process its GPU is device 0, so JAX's own default
  (``local_device_ids=None``: every visible device) is then the right one. Refused on TPUs: a process per chip needs
  the TPU runtime's process bounds and addresses, which jddp does not set (one process per host is TPU's own way).
* ``-n host``: one process that owns every local device (the default on TPUs, and on CPUs, where one process with
  several simulated devices is faster than several processes: in-process collectives instead of gloo).
* ``-n auto`` (the default): ``device`` on GPUs, ``host`` elsewhere.
* ``-n N``: N processes; on GPUs each a contiguous block of ``devices / N`` of them (N must divide the count).

The environment each process gets is in ``Placement.env``; the topology line each process prints at
``jddp.initialize`` names the devices from ``$JDDP_DEVICES``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path

PLATFORMS = ("cpu", "cuda", "rocm", "tpu")
ACCELERATORS = ("cuda", "rocm", "tpu")
MODES = ("auto", "device", "host")
# The driver variable that makes a process see only the devices it owns.
VISIBILITY = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}
ENV_DEVICES = "JDDP_DEVICES"  # the physical ids of the devices this process owns, for its topology line
ENV_PLATFORM = "JDDP_PLATFORM"  # the platform the launcher found


@dataclasses.dataclass(frozen=True)
class Inventory:
    """A host's platform and its accelerators, as the launcher found them.

    ``devices`` are the ids the driver knows them by (indices, or GPU UUIDs where a scheduler lists those); empty on
    ``cpu``. ``source`` says where they were read, for the launcher's first line.
    """

    platform: str
    devices: tuple[str, ...] = ()
    source: str = "default"

    def __post_init__(self) -> None:
        if self.platform not in PLATFORMS:
            raise ValueError(f"`platform` must be one of {PLATFORMS}, got platform={self.platform!r}.")
        if self.platform in ACCELERATORS and not self.devices:
            raise ValueError(f"an inventory of platform={self.platform!r} needs its devices, got none.")
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"`devices` lists a device twice: devices={self.devices!r}.")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Process ``local_rank`` of a host: the devices it owns and the variables that give them to it."""

    local_rank: int
    devices: tuple[str, ...]
    env: Mapping[str, str]


def _visible(value: str) -> tuple[str, ...]:
    """A visibility variable's devices: ``"0,3"`` -> ("0", "3"); ``""`` and ``"-1"`` (CUDA's "none") -> ()."""
    items = tuple(item.strip() for item in value.split(",") if item.strip())
    return () if items in ((), ("-1",)) else items


def _numbered(directory: Path, pattern: str) -> tuple[str, ...]:
    """The numbers N of the entries of ``directory`` named like ``pattern`` (a regex with one group), in order."""
    if not directory.is_dir():
        return ()
    found = (re.fullmatch(pattern, entry.name) for entry in directory.iterdir())
    return tuple(str(n) for n in sorted(int(m.group(1)) for m in found if m))


def _count(directory: Path) -> tuple[str, ...]:
    """One device per entry of ``directory`` (``/proc/driver/nvidia/gpus/<bus id>``), numbered in bus order."""
    return tuple(str(i) for i in range(len(list(directory.iterdir())))) if directory.is_dir() else ()


def inventory(env: Mapping[str, str] | None = None, root: str | os.PathLike = "/") -> Inventory:
    """This host's platform and accelerators, read from ``env`` (default ``os.environ``) and the device files under
    ``root`` (tests pass a directory that fakes ``/proc`` and ``/dev``). No JAX, nothing initialised.

    Example:
      >>> inventory({"CUDA_VISIBLE_DEVICES": "2,3"}, root="/nonexistent")
      Inventory(platform='cuda', devices=('2', '3'), source='CUDA_VISIBLE_DEVICES')
      >>> inventory({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0"}).platform
      'cpu'
    """
    env = os.environ if env is None else env
    root = Path(root)
    wanted = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if wanted and wanted[0] == "cpu":
        return Inventory("cpu", source="JAX_PLATFORMS")
    found: dict[str, tuple[tuple[str, ...], str]] = {}
    if "CUDA_VISIBLE_DEVICES" in env:
        found["cuda"] = (_visible(env["CUDA_VISIBLE_DEVICES"]), "CUDA_VISIBLE_DEVICES")
    else:
        gpus = _count(root / "proc/driver/nvidia/gpus")
        found["cuda"] = (gpus, "/proc/driver/nvidia/gpus") if gpus else (
            _numbered(root / "dev", r"nvidia(\d+)"), "/dev/nvidiaN"
        )  # fmt: skip
    for name in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        if name in env:
            found["rocm"] = (_visible(env[name]), name)
            break
    else:
        renders = _numbered(root / "dev/dri", r"renderD(\d+)") if (root / "dev/kfd").exists() else ()
        found["rocm"] = (tuple(str(i) for i in range(len(renders))), "/dev/kfd")
    if "TPU_VISIBLE_CHIPS" in env:
        found["tpu"] = (_visible(env["TPU_VISIBLE_CHIPS"]), "TPU_VISIBLE_CHIPS")
    else:
        chips = _numbered(root / "dev", r"accel(\d+)") or _numbered(root / "dev/vfio", r"(\d+)")
        found["tpu"] = (chips, "/dev/accelN" if _numbered(root / "dev", r"accel(\d+)") else "/dev/vfio/N")
    order = [p for p in wanted if p in ACCELERATORS] or ["cuda", "rocm", "tpu"]
    for platform in order:
        devices, source = found.get(platform, ((), ""))
        if devices:
            return Inventory(platform, devices, source)
    return Inventory("cpu", source="no accelerator found")


def resolve_mode(nprocs: str | int, inv: Inventory) -> str | int:
    """``-n``'s value as a mode (``"device"``, ``"host"``) or a count: ``auto`` is ``device`` on GPUs, else
    ``host``."""
    if nprocs == "auto":
        return "device" if inv.platform in ("cuda", "rocm") else "host"
    return nprocs


def place(nprocs: str | int, inv: Inventory, *, devices_per_process: int | None = None) -> tuple[Placement, ...]:
    """The processes of one host and what each owns, for ``-n nprocs`` (``auto``, ``device``, ``host`` or a count)
    on ``inv``.

    Raises:
      ValueError: naming the value and the inventory, when the placement cannot be made (a count that does not
        divide the GPUs, ``device`` on a CPU host or a TPU, simulated devices on an accelerator).

    Example:
      >>> eight = Inventory("cuda", tuple(map(str, range(8))))
      >>> [p.env["CUDA_VISIBLE_DEVICES"] for p in place("auto", eight)]
      ['0', '1', '2', '3', '4', '5', '6', '7']
      >>> [p.env["CUDA_VISIBLE_DEVICES"] for p in place(2, eight)]
      ['0,1,2,3', '4,5,6,7']
    """
    mode = resolve_mode(nprocs, inv)
    if devices_per_process is not None and inv.platform != "cpu":
        raise ValueError(
            f"--devices-per-process={devices_per_process} simulates CPU devices, but this host's platform is "
            f"{inv.platform} with {len(inv.devices)} device(s) (from {inv.source}): drop it (each process gets its "
            "devices from -n), or set JAX_PLATFORMS=cpu to run on the CPU."
        )
    if inv.platform == "cpu":
        if mode == "device":
            raise ValueError(
                "-n device puts one process on each accelerator, but this host has none (platform cpu, "
                f"{inv.source}): use -n N for N processes, or -n host (one process; --devices-per-process D "
                "simulates D devices in it)."
            )
        count = 1 if mode == "host" else int(mode)
        return tuple(Placement(rank, (), {ENV_PLATFORM: "cpu"}) for rank in range(count))
    count = {"device": len(inv.devices), "host": 1}.get(mode) if isinstance(mode, str) else mode
    assert count is not None
    if inv.platform == "tpu" and count != 1:
        raise ValueError(
            f"-n {nprocs} would start {count} processes on this TPU host ({len(inv.devices)} chips, from "
            f"{inv.source}), which needs the TPU runtime's process bounds and addresses set per process; jddp does "
            "not set them. Use -n host (the default on TPUs: one process owns the host's chips, as JAX runs on TPU "
            "VMs)."
        )
    if inv.platform == "tpu":  # the one process owns every chip: the TPU runtime's own default, nothing to set
        return (Placement(0, inv.devices, {ENV_PLATFORM: "tpu", ENV_DEVICES: ",".join(inv.devices)}),)
    if count < 1 or len(inv.devices) % count:
        raise ValueError(
            f"-n {nprocs} does not divide this host's {len(inv.devices)} {inv.platform} devices "
            f"({', '.join(inv.devices)}, from {inv.source}) evenly: every process must own as many devices (a "
            "data-parallel step is as slow as its slowest process). Use -n device, -n host or a divisor."
        )
    size = len(inv.devices) // count
    placements = []
    for rank in range(count):
        mine = inv.devices[rank * size : (rank + 1) * size]
        env = {ENV_PLATFORM: inv.platform, ENV_DEVICES: ",".join(mine), VISIBILITY[inv.platform]: ",".join(mine)}
        placements.append(Placement(rank, mine, env))
    return tuple(placements)
