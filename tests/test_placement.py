"""jddp.placement: the host inventory read from faked driver files and variables, and the placement of processes on
it, for every platform and mode (8 GPUs, a TPU host, a ROCm host, a CPU host), checked as a partition."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jddp import placement
from jddp.placement import Inventory


def fake_host(root: Path, files: list[str]) -> Path:
    """A directory that holds ``files`` (paths under a host's ``/``) as empty files or, ending in ``/``, folders."""
    for name in files:
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
    return root


HOSTS = {
    # name: (files under /, environment, expected platform, expected devices)
    "8-gpus-proc": (
        [f"proc/driver/nvidia/gpus/0000:{i:02x}:00.0/" for i in range(8)] + ["dev/nvidiactl", "dev/nvidia-uvm"],
        {},
        "cuda",
        tuple(map(str, range(8))),
    ),
    "4-gpus-dev-only": (
        [f"dev/nvidia{i}" for i in range(4)] + ["dev/nvidiactl", "dev/nvidia-uvm", "dev/nvidia-uvm-tools"],
        {},
        "cuda",
        ("0", "1", "2", "3"),
    ),
    "scheduler-gave-2": ([f"dev/nvidia{i}" for i in range(8)], {"CUDA_VISIBLE_DEVICES": "4,5"}, "cuda", ("4", "5")),
    "gpu-uuids": ([], {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, "cuda", ("GPU-aa", "GPU-bb")),
    "cuda-none-visible": ([f"dev/nvidia{i}" for i in range(2)], {"CUDA_VISIBLE_DEVICES": "-1"}, "cpu", ()),
    "cpu-asked-on-gpu-host": ([f"dev/nvidia{i}" for i in range(8)], {"JAX_PLATFORMS": "cpu"}, "cpu", ()),
    "tpu-v4": ([f"dev/accel{i}" for i in range(4)], {}, "tpu", ("0", "1", "2", "3")),
    "tpu-v5e": ([f"dev/vfio/{i}" for i in range(8)] + ["dev/vfio/vfio"], {}, "tpu", tuple(map(str, range(8)))),
    "rocm": (
        ["dev/kfd"] + [f"dev/dri/renderD{128 + i}" for i in range(4)] + ["dev/dri/card0"],
        {},
        "rocm",
        ("0", "1", "2", "3"),
    ),
    "renders-without-kfd": ([f"dev/dri/renderD{128 + i}" for i in range(2)], {}, "cpu", ()),
    "cpu": (["dev/null", "proc/"], {}, "cpu", ()),
}


@pytest.mark.parametrize("name", list(HOSTS))
def test_the_inventory_of_a_faked_host(tmp_path, name):
    files, env, platform, devices = HOSTS[name]
    found = placement.inventory(env, fake_host(tmp_path, files))
    assert (found.platform, found.devices) == (platform, devices), found


def check_partition(inv: Inventory, placed: tuple[placement.Placement, ...]) -> None:
    """Every device owned by exactly one process, as many each, each told its own through the driver's variable
    (none on TPU and CPU), the platform and devices named for the topology line."""
    assert [p.local_rank for p in placed] == list(range(len(placed)))
    owned = [d for p in placed for d in p.devices]
    assert sorted(owned) == sorted(inv.devices), (owned, inv.devices)
    assert len({len(p.devices) for p in placed}) == 1
    for p in placed:
        assert p.env[placement.ENV_PLATFORM] == inv.platform
        visibility = placement.VISIBILITY.get(inv.platform)
        if visibility is None:
            assert not set(p.env) & set(placement.VISIBILITY.values())
        else:
            assert p.env[visibility].split(",") == list(p.devices)
        if inv.platform != "cpu":
            assert p.env[placement.ENV_DEVICES] == ",".join(p.devices)


CASES = [
    # (inventory, -n, processes) : the defaults and the modes on each platform
    (Inventory("cuda", tuple(map(str, range(8)))), "auto", 8),
    (Inventory("cuda", tuple(map(str, range(8)))), "device", 8),
    (Inventory("cuda", tuple(map(str, range(8)))), "host", 1),
    (Inventory("cuda", tuple(map(str, range(8)))), 4, 4),
    (Inventory("cuda", ("4", "5")), "auto", 2),
    (Inventory("rocm", ("0", "1", "2", "3")), "auto", 4),
    (Inventory("tpu", ("0", "1", "2", "3")), "auto", 1),
    (Inventory("tpu", ("0", "1", "2", "3")), "host", 1),
    (Inventory("cpu"), "auto", 1),
    (Inventory("cpu"), "host", 1),
    (Inventory("cpu"), 3, 3),
]


@pytest.mark.parametrize(
    ("inv", "nprocs", "count"), CASES, ids=[f"{c[0].platform}{len(c[0].devices)}-{c[1]}" for c in CASES]
)
def test_placement_by_platform_and_mode(inv, nprocs, count):
    placed = placement.place(nprocs, inv)
    assert len(placed) == count
    check_partition(inv, placed)


def test_eight_gpus_one_process_each_sees_only_its_own():
    placed = placement.place("auto", Inventory("cuda", tuple(map(str, range(8)))))
    assert [dict(p.env) for p in placed] == [
        {"JDDP_PLATFORM": "cuda", "JDDP_DEVICES": str(i), "CUDA_VISIBLE_DEVICES": str(i)} for i in range(8)
    ]


@given(devices=st.integers(1, 16), nprocs=st.integers(1, 16))
def test_a_count_places_iff_it_divides_the_gpus(devices, nprocs):
    inv = Inventory("cuda", tuple(map(str, range(devices))))
    if devices % nprocs:
        with pytest.raises(ValueError, match=rf"-n {nprocs} does not divide this host's {devices} cuda devices"):
            placement.place(nprocs, inv)
    else:
        check_partition(inv, placement.place(nprocs, inv))


@pytest.mark.parametrize(
    ("inv", "nprocs", "kwargs", "match"),
    [
        (Inventory("cpu"), "device", {}, r"-n device puts one process on each accelerator, but this host has none"),
        (Inventory("tpu", ("0", "1", "2", "3")), "device", {}, r"-n device would start 4 processes on this TPU host"),
        (Inventory("tpu", ("0", "1", "2", "3")), 2, {}, r"-n 2 would start 2 processes on this TPU host"),
        (
            Inventory("cuda", ("0", "1")),
            "auto",
            {"devices_per_process": 4},
            r"--devices-per-process=4 simulates CPU devices, but this host's platform is cuda with 2 device",
        ),
    ],
    ids=["device-on-cpu", "device-on-tpu", "count-on-tpu", "simulated-on-gpu"],
)
def test_placements_that_cannot_be_made_are_refused_by_name(inv, nprocs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        placement.place(nprocs, inv, **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"platform": "gpu"}, r"`platform` must be one of .* got platform='gpu'"),
        ({"platform": "cuda"}, r"an inventory of platform='cuda' needs its devices"),
        ({"platform": "cuda", "devices": ("0", "0")}, r"`devices` lists a device twice"),
    ],
    ids=["unknown-platform", "accelerator-without-devices", "twice"],
)
def test_an_inventory_that_cannot_be_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Inventory(**kwargs)


# ------------------------------------------------------------------ what jddp launch gives each process


def launch_environments(argv: list[str], inv: Inventory) -> tuple[object, list[dict[str, str]]]:
    """``jddp launch argv -m train`` on a host of inventory ``inv``: its config and every local process's
    environment, as the launcher builds them (nothing started)."""
    from jddp.cli.launch import config as config_lib
    from jddp.cli.launch import environment

    config = config_lib.config_from_args(config_lib.get_args_parser().parse_args([*argv, "-m", "train"]), inv)
    coordinator = config.coordinator or "127.0.0.1:29500"
    return config, [environment.environment(config, r, coordinator, 0) for r in range(config.nprocs)]


GPUS8 = Inventory("cuda", tuple(map(str, range(8))), "/proc/driver/nvidia/gpus")


def test_jddp_launch_on_an_8_gpu_host_gives_each_process_its_own_gpu(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    config, envs = launch_environments(["--max-restarts", "1"], GPUS8)
    assert config.nprocs == 8 and config.platform == "cuda"
    assert not config.standby and config.spares  # standby would initialise a GPU the live process holds
    for rank, env in enumerate(envs):
        assert env["CUDA_VISIBLE_DEVICES"] == str(rank) and env["JDDP_DEVICES"] == str(rank)
        assert (env["JDDP_PROCESS_ID"], env["JDDP_LOCAL_RANK"], env["JDDP_NUM_PROCESSES"]) == (
            str(rank),
            str(rank),
            "8",
        )
        assert "GLIBC_TUNABLES" not in env  # the CPU all-reduce's allocator setting: CPU hosts only
        assert "JDDP_LOCAL_DEVICES" not in env


def test_two_hosts_of_4_gpus_number_the_processes_across_hosts():
    inv = Inventory("cuda", ("0", "1", "2", "3"))
    seen = {}
    for node in (0, 1):
        argv = ["--nnodes", "2", "--node-rank", str(node), "--coordinator", "10.0.0.1:29500"]
        _, envs = launch_environments(argv, inv)
        for rank, env in enumerate(envs):
            assert env["CUDA_VISIBLE_DEVICES"] == str(rank) and env["JDDP_NUM_PROCESSES"] == "8"
            assert env["JDDP_COORDINATOR"] == "10.0.0.1:29500"
            seen[int(env["JDDP_PROCESS_ID"])] = (node, env["CUDA_VISIBLE_DEVICES"])
    assert seen == {4 * node + gpu: (node, str(gpu)) for node in (0, 1) for gpu in range(4)}


def test_a_tpu_host_runs_one_process_that_owns_every_chip():
    config, envs = launch_environments([], Inventory("tpu", ("0", "1", "2", "3"), "/dev/accelN"))
    assert config.nprocs == 1 and not config.standby
    assert envs[0]["JDDP_DEVICES"] == "0,1,2,3" and envs[0]["JDDP_PLATFORM"] == "tpu"
    assert not set(envs[0]) & {"TPU_VISIBLE_CHIPS", "CUDA_VISIBLE_DEVICES"} - set(os.environ)


def test_a_cpu_host_keeps_the_cpu_defaults(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    config, envs = launch_environments(
        ["-n", "2", "--devices-per-process", "4", "--max-restarts", "1"], Inventory("cpu")
    )
    assert config.nprocs == 2 and config.standby and config.platform == "cpu"
    for env in envs:
        assert env["JDDP_LOCAL_DEVICES"] == "4" and env["JDDP_PLATFORM"] == "cpu"
        assert env["GLIBC_TUNABLES"].startswith("glibc.malloc.mmap_max=0")
        assert "CUDA_VISIBLE_DEVICES" not in env or env["CUDA_VISIBLE_DEVICES"] == os.environ.get(
            "CUDA_VISIBLE_DEVICES"
        )
    config, _ = launch_environments([], Inventory("cpu"))
    assert config.nprocs == 1  # -n auto on a CPU host: one process (several devices in it beat several processes)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--cpu-share"], r"--cpu-share pins XLA:CPU's compute threads .* on this cuda host"),
        (["-n", "3"], r"-n 3 does not divide this host's 8 cuda devices"),
        (
            ["--devices-per-process", "2"],
            r"--devices-per-process=2 simulates CPU devices, but this host's platform is cuda",
        ),
    ],
    ids=["cpu-share", "count", "simulated"],
)
def test_jddp_launch_refuses_what_an_accelerator_host_cannot_do(argv, match):
    with pytest.raises(ValueError, match=match):
        launch_environments(argv, GPUS8)


def test_each_gpu_process_joins_with_its_own_id_and_every_device_it_sees(monkeypatch):
    """The launcher's environment, read back by ``jddp.initialize``: ``jax.distributed.initialize``'s arguments of
    each of 8 GPU processes (its id, the group, ``local_device_ids=None``: its one visible GPU is its own)."""
    from jddp.runtime import join_settings

    _, envs = launch_environments([], GPUS8)
    for rank, env in enumerate(envs):
        for name, value in env.items():
            if name.startswith("JDDP_") or name == "CUDA_VISIBLE_DEVICES":
                monkeypatch.setenv(name, value)
        settings = join_settings.Settings.resolve(None, None, None, None, None, None, None)
        args = join_settings.join_arguments(
            settings, bind="127.0.0.1:0", local_device_ids=None, timeout_s=300, heartbeat_s=45, shutdown_s=5
        )
        assert (args["coordinator_address"], args["num_processes"], args["process_id"]) == ("127.0.0.1:29500", 8, rank)
        assert args["local_device_ids"] is None and settings.local_devices is None


def test_the_topology_line_names_the_devices_of_the_process_that_prints_it():
    from jddp.runtime import topology

    assert topology.describe(8, "cpu", 1, list(range(8)), None) == "jddp: 8 devices (cpu), 1 process x 8 local devices"
    assert topology.describe(16, "gpu", 2, list(range(8)), tuple(map(str, range(8)))) == (
        "jddp: 16 devices (gpu), 2 processes x 8 local devices; process 0 holds devices 0,1,2,3,4,5,6,7 "
        "(driver ids 0,1,2,3,4,5,6,7)"
    )
    assert topology.describe(8, "tpu", 1, [0, 1, 2, 3, 4, 5, 6, 7], None).endswith("holds devices 0,1,2,3,4,5,6,7")


@pytest.mark.parametrize(
    ("inv", "gloo"),
    [
        (GPUS8, False),
        (Inventory("tpu", ("0", "1", "2", "3")), False),
        (Inventory("rocm", ("0",)), False),
        (Inventory("cpu"), True),
    ],
    ids=["8-gpus", "tpu", "rocm", "cpu"],
)
def test_gloo_is_set_up_only_for_the_cpu_hosts_processes(inv, gloo):
    """The launcher's environment read back by ``initialize``'s backend setup: gloo on a CPU host, not on an
    accelerator host (its collectives are NCCL's or the TPU's)."""
    from jddp.runtime import distributed

    _, envs = launch_environments([], inv)
    assert distributed.uses_gloo(None, None, envs[0]["JDDP_PLATFORM"]) is gloo
