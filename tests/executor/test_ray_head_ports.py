"""The private Ray head's fixed-default servers get ports below the kernel's ephemeral
range. A port from bind(0) lies inside it, and before the runtime-env agent binds it,
an outgoing connection on the node's address can take it: the agent then fails with
"Address already in use" and its raylet exits, which ended a CI run (stop 47's clone).
"""

from __future__ import annotations

import pytest

from pagoda.executor.ray_head import _own_ports
from pagoda.free_ports import PORT_FLOOR, _ephemeral_floor


def test_the_heads_own_ports_are_below_the_ephemeral_range():
    if _ephemeral_floor() - PORT_FLOOR < 1000:
        pytest.skip("this machine's ephemeral range leaves no room below it")
    flags = _own_ports()
    assert {flag.split("=")[0] for flag in flags} >= {"--runtime-env-agent-port",
                                                      "--dashboard-agent-grpc-port"}
    ports = [int(flag.split("=")[1]) for flag in flags]
    assert len(set(ports)) == len(ports)
    assert all(PORT_FLOOR <= port < _ephemeral_floor() for port in ports), ports
