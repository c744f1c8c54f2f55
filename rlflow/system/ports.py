"""Free TCP ports for the servers a launch starts (buffer, weight coordinator, ``jax.distributed``),
and the addresses those servers bind and advertise.

The launcher picks each port, hands it to a child process in its environment, and the child
binds it seconds later (after importing jax). A port from ``bind(port=0)`` lies in the
kernel's ephemeral range, the same range the kernel draws from for every outgoing
connection on the machine, so in that window an unrelated ``connect()`` can take it and the
child fails with ``Address already in use`` (seen once in ~45 starts on a busy 2-core host).
:func:`free_port` therefore draws below the ephemeral range, where the kernel never assigns a
port by itself; only another program choosing the same explicit port can still collide.
"""

from __future__ import annotations

import random
import socket
from typing import Collection, Tuple

# Linux's default ``net.ipv4.ip_local_port_range`` starts here, and macOS's and Windows' at
# 49152: below it no ephemeral port is ever handed out on any of them.
_DEFAULT_EPHEMERAL_LOW = 32768
_LOWEST = 10000                 # below: well-known and commonly configured service ports
_ATTEMPTS = 200


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> Tuple[int, int]:
    """The kernel's ephemeral port range ``(low, high)``, inclusive.

    Read from ``path`` on Linux; elsewhere (or if unreadable) ``(32768, 65535)``.
    """
    try:
        with open(path) as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL_LOW, 65535


def _bindable(host: str, port: int, *, reuse_address: bool = False) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_taken(host: str, port: int) -> bool:
    """Another socket listens on ``host:port`` now (a bind with ``SO_REUSEADDR``, as ZeroMQ's
    listeners use, fails; a port only in TIME_WAIT after an earlier run counts free)."""
    return not _bindable(host, port, reuse_address=True)


def free_port(host: str = "127.0.0.1", *, exclude: Collection[int] = ()) -> int:
    """A TCP port that nothing on ``host`` is bound to now, outside the ephemeral range.

    Args:
      host: the address the port will be bound on (IPv4).
      exclude: ports already handed out for the same launch (so two servers never get one).

    Returns:
      a port in ``[10000, ephemeral low)``, chosen at random among the free ones; if that
      range is empty or full (a host whose ephemeral range starts below 10000), a port from
      ``bind(port=0)``.
    """
    low = min(ephemeral_range()[0], _DEFAULT_EPHEMERAL_LOW)
    rng = random.SystemRandom()
    if low - _LOWEST > 100:
        for _ in range(_ATTEMPTS):
            port = rng.randrange(_LOWEST, low)
            if port not in exclude and _bindable(host, port):
                return port
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in exclude:
            return port


WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*")


def is_wildcard(host: str) -> bool:
    """True for a bind address meaning every interface (:data:`WILDCARD_HOSTS`)."""
    return host in WILDCARD_HOSTS


def advertised_host(bind_address: str) -> str:
    """The host other machines reach this one at: ``bind_address``, or this host's address
    (``socket.gethostbyname(socket.gethostname())``) when bound to all interfaces."""
    return socket.gethostbyname(socket.gethostname()) if is_wildcard(bind_address) else \
        bind_address
