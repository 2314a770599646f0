"""Ports for a process to bind later: picked here, bound by the caller (or a child).

Between the pick and the bind the port is only a number, and two things used to take
it: another `free_port()` handing out the same number (the kernel's bind(0) may give
one port twice once the first socket is closed: `pagoda bench startup` saw its gateway
port handed again to a tokenizer's metrics server), and any bind(0) or outgoing
connection, which take ports from the kernel's ephemeral range. So ports come from
below that range (from PORT_FLOOR up: Ray's worker ports end at 19999), in turn
from a counter shared by every process of this user on the machine (a locked file
in the temp dir), each checked free at the pick.

Invariant: no two calls on this machine return the same port until the range
(~12,000 ports) wraps around, and no port returned is in the ephemeral range where
that range leaves room; where it does not, bind(0) decides, as before.
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile

PORT_FLOOR = 20000
_COUNTER = os.path.join(tempfile.gettempdir(), f"pagoda-free-ports-{os.getuid()}")


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now and no other call has just handed out (the
    caller binds it soon after)."""
    top = _ephemeral_floor()
    span = top - PORT_FLOOR
    if span < 1000:  # a machine whose ephemeral range starts low: the kernel's pick
        return _kernel_port(host)
    try:
        fd = os.open(_COUNTER, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return _kernel_port(host)
    with os.fdopen(fd, "r+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)  # released when the file closes
        text = counter.read().strip()
        # The first pick on a machine starts anywhere in the range: two machines'
        # test runs sharing nothing still spread out.
        offset = int(text) if text.isdigit() else int.from_bytes(os.urandom(2), "big")
        for i in range(span):
            port = PORT_FLOOR + (offset + i) % span
            if _bindable(host, port):
                counter.seek(0)
                counter.truncate()
                counter.write(str((offset + i + 1) % span))
                return port
    return _kernel_port(host)
