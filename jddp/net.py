"""Addresses and ports: what the launcher and the runtime both need. Imports no JAX."""

from __future__ import annotations

import socket


def split_address(address: str, *, name: str = "coordinator") -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``; IPv6 hosts may be bracketed (``"[::1]:29500"``).

    Raises:
      ValueError: naming ``name=address`` when it is not ``host:port`` with a port from 1 to 65535.

    Example:
      >>> split_address("10.0.0.1:29500"), split_address("[::1]:8476")
      (('10.0.0.1', 29500), ('::1', 8476))
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={address!r} must be 'host:port' with a port from 1 to 65535, e.g. '127.0.0.1:29500'.")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface."""
    return host in ("localhost", "::1") or host.startswith("127.")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (another program may take it before it is used)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
