"""End-to-end fixtures: the real services via `pagoda serve`, a real Redis, the openai client."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def redis_server(shared_redis):
    """The Redis of the shared tiny cluster: the tests that read what it indexed need the
    same one, and the modules that start their own cluster can share it too."""
    return shared_redis


@pytest.fixture(scope="module")
def tiny_cluster(plain_tiny_cluster):
    """The tiny random Llama served by all five services (Redis given by URL), shared with
    the other modules that serve it with the same flags (tests/shared_clusters.py)."""
    return plain_tiny_cluster


@pytest.fixture
def tiny_client(tiny_cluster):
    return openai.OpenAI(base_url=tiny_cluster.url, api_key="unused", max_retries=0, timeout=120)
