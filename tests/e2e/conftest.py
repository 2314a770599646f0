"""End-to-end fixtures: the real services via `pagoda serve`, a real Redis, the openai client."""

from __future__ import annotations

import openai
import pytest
from serve_cluster import ServeProcess

from pagoda.services.common.redis_server import PrivateRedis


@pytest.fixture(scope="module")
def redis_server():
    with PrivateRedis() as server:
        yield server


@pytest.fixture(scope="module")
def tiny_cluster(tiny_llama_dir, redis_server):
    """The tiny random Llama served by all five services (Redis given by URL)."""
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "1024", "--redis-url", redis_server.url])
    yield serve
    code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]


@pytest.fixture
def tiny_client(tiny_cluster):
    return openai.OpenAI(base_url=tiny_cluster.url, api_key="unused", max_retries=0, timeout=120)
