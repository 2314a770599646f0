"""Clusters shared by several test modules: started on first use, stopped after the last.

A served cluster costs tens of seconds to start on a 2-core machine (and a P/D one twice
that), so modules that need the same `pagoda serve` command line share one instead of
each starting its own. Registered as a plugin by tests/conftest.py.

A shared cluster is a session fixture declared with `@shared_cluster`. Invariants:
- the modules that use it run one after another (`pytest_collection_modifyitems` moves
  the later ones up behind the first, keeping their own order), and it is stopped right
  after the last selected test that uses it, so it is never idle while other tests run
  (its processes hold gigabytes);
- no test changes its flags, kills one of its services or relies on its counters
  starting at zero (compare before/after instead); a test that needs any of that starts
  its own cluster.

`plain_tiny_cluster` is the tiny random Llama served by all five services with nothing
but the model's shape set (float32, 1,024 tokens, 16-token blocks) and its own Redis
(`shared_redis`): e2e's `tiny_cluster` and the colocated cluster the disaggregation
tests compare against.
"""

from __future__ import annotations

from typing import Callable

import pytest
from serve_cluster import ServeProcess

from pagoda.services.common.redis_server import PrivateRedis

PLAIN_TINY_FLAGS = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len",
                    "1024", "--block-size", "16"]

SHARED_CLUSTERS: list[str] = []  # fixture names, in declaration order
_stoppers: dict[str, Callable[[], object]] = {}  # fixture name -> stop(), while it runs
_last_users: dict[str, str] = {}  # fixture name -> node id of its last selected test


def shared_cluster(function):
    """@pytest.fixture(scope="session") for a cluster several modules share; the fixture
    calls `running(name, stop)` once its cluster serves."""
    SHARED_CLUSTERS.append(function.__name__)
    return pytest.fixture(scope="session")(function)


def running(name: str, stop: Callable[[], object]) -> None:
    """Declare shared cluster `name` started: `stop()` runs after its last test (and must
    be safe to call again from the fixture's own teardown)."""
    _stoppers[name] = stop


def _uses(items: list[pytest.Item], name: str) -> bool:
    return any(name in getattr(item, "fixturenames", ()) for item in items)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the modules that use a shared cluster up behind the first one that does."""
    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(str(item.path), []).append(item)
    order = list(modules)
    for name in SHARED_CLUSTERS:
        users = [m for m in order if _uses(modules[m], name)]
        if len(users) < 2:
            continue
        rest = [m for m in order if m not in users[1:]]
        at = rest.index(users[0]) + 1
        order = rest[:at] + users[1:] + rest[at:]
    items[:] = [item for module in order for item in modules[module]]


def pytest_collection_finish(session: pytest.Session) -> None:
    """Note each shared cluster's last test among those selected (after -m and -k)."""
    _last_users.clear()
    for item in session.items:
        for name in SHARED_CLUSTERS:
            if name in getattr(item, "fixturenames", ()):
                _last_users[name] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    """After the last test of a shared cluster, stop it (Redis and the like stay)."""
    yield
    for name, nodeid in _last_users.items():
        if nodeid == item.nodeid and name in _stoppers:
            _stoppers.pop(name)()


@pytest.fixture(scope="session")
def shared_redis():
    """The Redis of `plain_tiny_cluster` (the e2e tests' `redis_server` too)."""
    with PrivateRedis() as server:
        yield server


@shared_cluster
def plain_tiny_cluster(tiny_llama_dir, shared_redis):
    """The tiny model served with PLAIN_TINY_FLAGS, one replica."""
    serve = ServeProcess([tiny_llama_dir, *PLAIN_TINY_FLAGS, "--redis-url", shared_redis.url])
    running("plain_tiny_cluster", serve.stop)
    yield serve
    code = serve.stop()
    assert code == 0, serve.stderr_text()[-3000:]
