"""A scheduler SIGKILLed under several requests that share its one `GenerateStream`.

`pagoda serve --data-parallel-size 2` (tiny model, real processes): the gateway sends
every request to a replica over one multiplexed stream. Killing replica 1's scheduler
while it streams several requests must fail all of them at once the way a broken
per-request `Generate` call did: each migrates to replica 0 and ends with the text it
would have had (greedy), none hangs, and the gateway counts a replica_lost migration
for each.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
from serve_cluster import wait_until
from test_chaos import migrations, replica_processes, running, start_cluster

pytestmark = pytest.mark.slow

REQUESTS = 8  # round robin: half of them on the victim, all on its one stream
MAX_TOKENS = 160


def body(i: int) -> dict:
    return {"model": "tiny", "prompt": f"Request {i} tells a long story about", "max_tokens":
            MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}


async def stream_one(client: httpx.AsyncClient, url: str, request: dict) -> dict:
    text, finish, errors = [], None, []
    async with client.stream("POST", f"{url}/completions",
                             json={**request, "stream": True}) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            for choice in event["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return {"text": "".join(text), "finish_reason": finish, "errors": errors}


def test_a_killed_scheduler_fails_its_streams_requests_and_they_migrate(tiny_llama_dir,
                                                                        redis_server):
    serve = start_cluster(tiny_llama_dir, redis_server.url)
    try:
        expected = [httpx.post(f"{serve.url}/completions", json=body(i), timeout=120
                               ).json()["choices"][0]["text"] for i in range(REQUESTS)]
        victim = replica_processes(serve, 1)
        before = migrations(serve).get("replica_lost", 0.0)

        async def load():
            async with httpx.AsyncClient(timeout=180) as client:
                tasks = [asyncio.ensure_future(stream_one(client, serve.url, body(i)))
                         for i in range(REQUESTS)]
                # Several requests running on the victim (their tokens streaming), then kill.
                assert await asyncio.to_thread(
                    wait_until, lambda: running(victim["port"]) >= 2, 60, 0.02)
                await asyncio.sleep(0.3)
                os.kill(victim["scheduler"], signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 180)

        results = asyncio.run(load())
        assert [r["errors"] for r in results] == [[]] * REQUESTS
        assert [r["finish_reason"] for r in results] == ["length"] * REQUESTS
        assert [r["text"] for r in results] == expected  # continued exactly elsewhere
        lost = migrations(serve).get("replica_lost", 0.0) - before
        assert lost >= 2, f"{lost} migrations counted"
        # They were on one stream, which failed with all of them on it.
        failed = [line for line in serve.log if "generate stream to" in line
                  and "failed with" in line]
        assert any(int(line.split("failed with ")[1].split()[0]) >= 2 for line in failed), failed
    finally:
        serve.stop()
