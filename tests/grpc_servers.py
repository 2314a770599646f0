"""In-process gRPC servers for the service tests: one servicer beside the health service."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2_grpc


def start_grpc_server(add_fn, servicer, address: str = "127.0.0.1:0",
                      max_workers: int = 8) -> tuple[grpc.Server, str]:
    """`servicer` (registered by its generated `add_fn`) and the gRPC health service,
    started on `address` (port 0: a free one): (the server, its host:port). A fixed port
    that cannot be bound fails the test instead of serving elsewhere."""
    server = grpc.server(ThreadPoolExecutor(max_workers=max_workers))
    add_fn(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    host, _, port = address.rpartition(":")
    bound = server.add_insecure_port(address)
    assert port == "0" or bound == int(port), f"could not listen on {address}"
    server.start()
    return server, f"{host}:{bound}"
