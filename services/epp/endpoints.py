"""Which HTTP endpoint (`ip:port`) a Pagoda scheduler replica is reached at.

A pool member of an InferencePool is a model-server pod that serves the OpenAI API.
In Pagoda that pod runs one scheduler replica (and its gpu-worker) with a gateway
beside it whose only replica is that scheduler (`--scheduler-addrs 127.0.0.1:PORT`).
So the member's endpoint is the scheduler's host at the pool's target port (the
gateway's HTTP port, the InferencePool's `targetPorts`). Invariant: `endpoint(r)` is a
pure function of the replica's gRPC address; `--endpoint-map` overrides it per address,
for members that do not share a host with their scheduler (every process on one
loopback address, as in the tests).
"""

from __future__ import annotations


def parse_endpoint_map(text: str | None) -> dict[str, str]:
    """'SCHED_HOST:PORT=IP:PORT,...' -> {scheduler address: endpoint}; ValueError names
    the bad entry."""
    mapping: dict[str, str] = {}
    for entry in (text or "").split(","):
        entry = entry.strip()
        if not entry:
            continue
        scheduler, sep, endpoint = entry.partition("=")
        if not sep or not _is_host_port(scheduler) or not _is_host_port(endpoint):
            raise ValueError(f"--endpoint-map entry {entry!r} is not "
                             "SCHEDULER_HOST:PORT=ENDPOINT_IP:PORT")
        mapping[scheduler.strip()] = endpoint.strip()
    return mapping


class EndpointResolver:
    def __init__(self, target_port: int, overrides: dict[str, str] | None = None) -> None:
        self.target_port = target_port
        self.overrides = dict(overrides or {})

    def endpoint(self, replica) -> str:
        address = replica.address
        if address in self.overrides:
            return self.overrides[address]
        host = address.rsplit(":", 1)[0]
        return f"{host}:{self.target_port}"


def _is_host_port(text: str) -> bool:
    host, _, port = text.strip().rpartition(":")
    return bool(host) and port.isdigit()
