"""Fixtures for the service tests: a real Redis, in-process gRPC servers."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2_grpc
import pytest



class Served(NamedTuple):
    channel: grpc.Channel
    address: str
    server: grpc.Server


@contextlib.contextmanager
def _grpc_servers():
    """start(add_fn, servicer) -> Served: an in-process server (with the gRPC health
    service) on a free port, and a channel to it."""
    servers, channels = [], []

    def start(add_fn, servicer) -> Served:
        server = grpc.server(ThreadPoolExecutor(max_workers=8))
        add_fn(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        channels.append(channel)
        return Served(channel, f"127.0.0.1:{port}", server)

    try:
        yield start
    finally:
        for channel in channels:
            channel.close()
        for server in servers:
            server.stop(None)


@pytest.fixture
def grpc_server_factory():
    with _grpc_servers() as start:
        yield start


@pytest.fixture(scope="module")
def grpc_server_factory_module():
    with _grpc_servers() as start:
        yield start
