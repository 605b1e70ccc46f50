"""The ``jddp`` command: ``jddp --version``, ``jddp info``, ``jddp launch``, ``jddp bench``, ``jddp goodput``.

Subcommands import JAX only when they run, so that ``jddp launch`` (the parent
of the worker processes) never starts a JAX backend.
"""

from __future__ import annotations

import argparse
import sys

from jddp import _version, envvars


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jddp", description="Data-parallel training for JAX.")
    parser.add_argument("--version", action="version", version=f"jddp {_version.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="print JAX version, backend, devices per process and process count")
    info.add_argument(
        "--simulate-devices",
        type=envvars.count(1),
        default=None,
        metavar="N",
        help="simulate N CPU devices first, for a dry run (default: $JDDP_LOCAL_DEVICES if set, else the devices "
        "JAX finds)",
    )
    sub.add_parser(
        "launch", help="run a script as several processes; restart on failure (`jddp launch --help`)", add_help=False
    )
    sub.add_parser(
        "goodput",
        help="where a fit run's wall time went, across restarts (`jddp goodput RUN_DIR [--run ID]`)",
        add_help=False,
    )
    sub.add_parser(
        "bench",
        help="throughput, speedup, efficiency and latency over device counts (`jddp bench --help`)",
        add_help=False,
    )
    return parser


def info(simulate_devices: int | None = None) -> str:
    """The environment as jddp sees it, one ``key: value`` per line.

    ``simulate_devices`` defaults to ``$JDDP_LOCAL_DEVICES`` (what ``jddp launch --devices-per-process`` sets), so
    that ``jddp info`` under the launcher's variables reports the devices a script would get."""
    import jax

    from jddp import runtime
    from jddp.runtime import distributed

    if simulate_devices is None:  # the launcher's JDDP_LOCAL_DEVICES, as jddp.initialize applies it
        simulate_devices = envvars.get(distributed.ENV_LOCAL_DEVICES)
    if simulate_devices is not None:
        runtime.simulate_cpu_devices(simulate_devices)
    rows = {
        "jddp": _version.__version__,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "local_devices": jax.local_device_count(),
        "global_devices": jax.device_count(),
        "devices": ", ".join(str(d) for d in jax.local_devices()),
        "topology": distributed.topology_line().removeprefix("jddp: "),
    }
    return "\n".join(f"{k}: {v}" for k, v in rows.items())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:
        from jddp.cli import launch

        return launch.main(argv[1:])
    if argv[:1] == ["goodput"]:
        from jddp import goodput

        return goodput.main(argv[1:])
    if argv[:1] == ["bench"]:
        from jddp.cli import bench

        return bench.main(argv[1:])
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.command == "info":
        try:
            print(info(args.simulate_devices))
        except ValueError as error:  # a malformed $JDDP_LOCAL_DEVICES, named by jddp.envvars
            print(f"jddp info: {error}", file=sys.stderr)
            return 2
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
