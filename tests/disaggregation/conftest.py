"""Fixtures for the disaggregation tests (the cluster helpers live in pd_cluster.py: a
`conftest` module name is ambiguous when several folders' conftests are on sys.path)."""

from __future__ import annotations

import pytest

from pagoda.services.common.redis_server import PrivateRedis


@pytest.fixture(scope="module")
def redis_server():
    server = PrivateRedis().start()
    yield server
    server.stop()
