"""Fixtures for the routing tests: a real Redis, in-process gRPC servers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc
import pytest
from grpc_health.v1 import health, health_pb2_grpc



class Served(NamedTuple):
    server: grpc.Server
    address: str


@pytest.fixture
def grpc_server_factory():
    """start(add_fn, servicer) -> Served: a server (with gRPC health) on a free port."""
    servers = []

    def start(add_fn, servicer) -> Served:
        server = grpc.server(ThreadPoolExecutor(max_workers=8))
        add_fn(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return Served(server, f"127.0.0.1:{port}")

    yield start
    for server in servers:
        server.stop(None)
