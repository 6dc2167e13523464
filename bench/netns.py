"""A private network namespace for benchmark runs that start NVIDIA Dynamo.

Dynamo's event-plane sockets (ZMQ PUB and ROUTER) bind 0.0.0.0 and no option changes that
(its advertised address is configurable, its bind address is not). A run that starts Dynamo
therefore runs whole, fleet, routers and load generator, in a network namespace of its own
(``unshare --net``, as root), whose only interface is its own loopback: whatever binds
0.0.0.0 there is reachable from nothing but that loopback, and the namespace ends with the
run. Package installs happen before (the namespace has no route to a registry).

    python -m kvgate.bench.netns CMD ARGS...   # loopback up, check, then exec CMD
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import struct
import sys
from collections.abc import Sequence

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14s"


class NetnsError(RuntimeError):
    """No private network namespace can be had here, or the one we are in is not private."""


def interfaces() -> list[str]:
    """Names of the network interfaces of this process's namespace."""
    return sorted(name for _index, name in socket.if_nameindex())


def only_loopback() -> bool:
    """Whether this namespace has no interface but ``lo`` (nothing can listen off it)."""
    return interfaces() == ["lo"]


def loopback_up() -> None:
    """Bring ``lo`` up (a new namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack(_IFREQ, b"lo", 0, bytes(14))
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request)[:18])[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP, bytes(14)))


def private_argv(command: Sequence[str]) -> list[str]:
    """``command`` run in a new network namespace with its loopback up."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise NetnsError("a private network namespace needs unshare (util-linux)")
    return [unshare, "--net", "--", sys.executable, "-m", "kvgate.bench.netns", *command]


def reexec_private(command: Sequence[str]) -> None:
    """Replace this process by ``command`` in a private network namespace (never returns)."""
    argv = private_argv(command)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def main(argv: Sequence[str]) -> int:
    if not argv:
        print("usage: python -m kvgate.bench.netns CMD [ARGS...]", file=sys.stderr)
        return 2
    if not only_loopback():
        print(f"not a private network namespace: interfaces {interfaces()}", file=sys.stderr)
        return 1
    loopback_up()
    os.execvp(argv[0], list(argv))
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
