"""Addresses and ports: what the launcher and the runtime both need. Imports no JAX."""

from __future__ import annotations

import errno
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


def check_port_free(host: str, port: int) -> None:
    """Raises, naming the address and the fix, unless the coordination service can listen on ``host:port``.

    Raises:
      OSError: ``EADDRINUSE`` when another program listens there; the bind error otherwise.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(
                    errno.EADDRINUSE,
                    f"The coordinator address {host}:{port} is already in use by another program, so the "
                    "coordination service cannot start there. Pick another port (`jddp launch --coordinator "
                    f"{host}:<port>`), or leave --coordinator out and jddp launch picks a free one.",
                ) from None
            raise OSError(e.errno, f"Cannot bind the coordinator address {host}:{port}: {e.strerror}.") from None


def answers(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at ``host:port`` within ``timeout_s`` (closed at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
