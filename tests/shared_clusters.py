"""Clusters shared by several test modules: started once per session, on first use.

A served cluster costs tens of seconds to start on a 2-core machine, so modules that
need the same `pagoda serve` command line share one instead of each starting its own.
Registered as a plugin by tests/conftest.py.

`plain_tiny_cluster` is the tiny random Llama served by all five services with nothing
but the model's shape set (float32, 1,024 tokens, 16-token blocks) and its own Redis
(`shared_redis`). Invariant for every user: no test changes its flags, kills one of its
services or relies on its counters starting at zero (compare before/after instead); a
test that needs any of that starts its own cluster.
"""

from __future__ import annotations

import pytest
from serve_cluster import ServeProcess

from pagoda.services.common.redis_server import PrivateRedis

PLAIN_TINY_FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len",
                    "1024", "--block-size", "16"]


@pytest.fixture(scope="session")
def shared_redis():
    """The Redis of `plain_tiny_cluster` (the e2e tests' `redis_server` too)."""
    with PrivateRedis() as server:
        yield server


@pytest.fixture(scope="session")
def plain_tiny_cluster(tiny_llama_dir, shared_redis):
    """The tiny model served with PLAIN_TINY_FLAGS: e2e's `tiny_cluster`, and the colocated
    cluster the disaggregation tests compare against."""
    serve = ServeProcess([tiny_llama_dir, *PLAIN_TINY_FLAGS, "--redis-url", shared_redis.url])
    yield serve
    code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]
