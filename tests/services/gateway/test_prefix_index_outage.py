"""The prefix index is never on a request's critical path: a kv-cache-manager (or its
Redis) that is down or frozen makes the router weigh load alone, and is not asked again
for BACKOFF_S, so an outage costs requests no lookup time; then it is asked again."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagoda.services.gateway.routing import prefix_index
from pagoda.services.gateway.routing.prefix_index import PrefixIndexClient


class FailingStub:
    """LookupPrefix fails with `code` (a frozen manager: DEADLINE_EXCEEDED) until healed."""

    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code
        self.calls = 0
        self.healed = False

    async def LookupPrefix(self, request, timeout):  # noqa: N802 (the RPC's name)
        self.calls += 1
        if self.healed:
            return type("Reply", (), {"num_cached_blocks": {"replica-0": 2},
                                          "num_host_blocks": {}, "num_disk_blocks": {}})()
        raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details="index unreachable")


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_down_or_frozen_index_is_skipped_for_a_while_then_asked_again(code, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(prefix_index.time, "monotonic", lambda: clock[0])

    async def run():
        client = PrefixIndexClient("127.0.0.1:1")
        stub = FailingStub(code)
        client.stub = stub
        hashes = [b"a" * 32, b"b" * 32]
        lookup = lambda: client.lookup(None, [1, 2], hashes, "", "m", 16)  # noqa: E731
        first = await lookup()
        clock[0] += prefix_index.BACKOFF_S / 2
        during = await lookup()
        calls_during = stub.calls
        stub.healed = True
        clock[0] += prefix_index.BACKOFF_S
        after = await lookup()
        await client.close()
        return first, during, calls_during, after

    first, during, calls_during, after = asyncio.run(run())
    assert first is None and during is None  # the router weighs load alone
    assert calls_during == 1  # the second request did not wait on the index
    assert after == ([b"a" * 32, b"b" * 32], {"replica-0": 2}, {})  # taken back
