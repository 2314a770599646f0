"""Fixtures for the service tests: a real Redis, in-process gRPC servers."""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import grpc
import pytest
from grpc_servers import start_grpc_server


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
        server, address = start_grpc_server(add_fn, servicer)
        servers.append(server)
        channel = grpc.insecure_channel(address)
        channels.append(channel)
        return Served(channel, address, server)

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
