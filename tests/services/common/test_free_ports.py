"""free_port: ports outside the kernel's ephemeral range, never handed out twice in a
row across processes, and skipping a port somebody already listens on."""

from __future__ import annotations

import socket
import subprocess
import sys

from pagoda import free_ports
from pagoda.free_ports import PORT_FLOOR, free_port

PICKS = """
from pagoda.free_ports import free_port
print(" ".join(str(free_port()) for _ in range(150)))
"""


def test_ports_are_below_the_ephemeral_range():
    top = free_ports._ephemeral_floor()
    for _ in range(20):
        assert PORT_FLOOR <= free_port() < top


def test_two_processes_picking_at_once_never_get_the_same_port():
    """What bind(0) could not promise: a port picked by one process (a bench) and
    another picked by a second (the server it starts) are different numbers."""
    procs = [subprocess.Popen([sys.executable, "-c", PICKS], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    picks = [int(p) for proc in procs for p in proc.communicate(timeout=60)[0].split()]
    assert all(proc.returncode == 0 for proc in procs)
    assert len(picks) == 300
    assert len(set(picks)) == 300


def test_a_port_in_use_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(free_ports, "_COUNTER", str(tmp_path / "counter"))
    span = free_ports._ephemeral_floor() - PORT_FLOOR
    first = free_port()  # starts the counter somewhere in the range
    nxt = PORT_FLOOR + (first - PORT_FLOOR + 1) % span
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        try:
            busy.bind(("127.0.0.1", nxt))
        except OSError:  # taken already: the skip is what this test checks anyway
            pass
        else:
            busy.listen()
        got = free_port()
    assert got != nxt
    assert got == PORT_FLOOR + (nxt - PORT_FLOOR + 1) % span
