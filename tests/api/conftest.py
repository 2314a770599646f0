"""Fixtures for the OpenAI API tests: a gateway over fakes (fast) or a real cluster (slow)."""

from __future__ import annotations

import openai
import pytest
from api_fakes import Gateway, Peers
from serve_cluster import scheduler_load


@pytest.fixture(scope="module")
def fake_peers(smollm2_tokenizer):
    peers = Peers(smollm2_tokenizer)
    yield peers
    peers.stop()


@pytest.fixture(scope="module")
def gateway(fake_peers):
    gw = Gateway(fake_peers)
    yield gw
    gw.stop()


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                         timeout=30)


@pytest.fixture
def last_request(gateway):
    """The last GenerateRequest the fake scheduler received."""
    return lambda: gateway.scheduler.requests[-1]


@pytest.fixture(scope="module")
def load(cluster):
    """() -> the GetLoadResponse of the scheduler of the module's own `cluster` fixture
    (a real cluster's tests)."""
    address = cluster.scheduler_address()
    return lambda: scheduler_load(address, timeout=5)
