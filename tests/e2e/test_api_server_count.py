"""`pagoda serve --api-server-count 2`: two gateway processes on one port.

Requests land on both (each answer names its process in `X-Pagoda-Api-Server`; the pid
file maps the index to a pid), `/metrics` on the port counts every request once over
both, and a process SIGKILLed under streamed load costs only the streams open on it,
each ending in a clean error (never a hang), while the other's complete; the parent
restarts it (`pagoda_service_restarts_total{service="gateway-api-server-K"}`) and
`/health` answers 200.

Real processes on loopback, the tiny model, the official `openai` client; each request
on a connection of its own, so the header says which process served it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter

import httpx
import openai
import pytest
from serve_cluster import ServeProcess, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended

HEADER = "x-pagoda-api-server"
REQUEST_BOUND_S = 240.0  # detects a hang, not a speed (a shared 2-core machine stalls)
STREAMS, CONCURRENCY, KILL_AFTER, MAX_TOKENS = 24, 8, 6, 32


@pytest.fixture(scope="module")
def pid_file(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("api_servers") / "gateway.pids.json")


@pytest.fixture(scope="module")
def serve(tiny_llama_dir, redis_server, pid_file):
    cluster = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                            "--max-model-len", "512", "--redis-url", redis_server.url,
                            "--disable-log-stats", "--api-server-count", "2",
                            "--api-server-pid-file", pid_file], timeout=400)
    yield cluster
    cluster.stop()


def api_server_pids(pid_file: str) -> dict[str, int]:
    with open(pid_file) as f:
        return json.load(f)["api_servers"]


def completions_counted(serve: ServeProcess) -> float:
    return serve.scrape().get(("pagoda_gateway_http_requests_total", frozenset(
        {"route": "/v1/completions", "method": "POST", "status": "200"}.items())), 0.0)


def restarts(serve: ServeProcess) -> dict[str, float]:
    return {dict(labels)["service"]: value for (name, labels), value in serve.scrape().items()
            if name == "pagoda_service_restarts_total"}


def test_requests_land_on_both_processes_and_metrics_count_each_once(serve, pid_file):
    pids = api_server_pids(pid_file)
    assert sorted(pids) == ["0", "1"] and len(set(pids.values())) == 2
    assert set(serve.api_server_pids()) == set(pids.values())  # the parent's children
    assert f"api server 1 of 2: pid {pids['1']}" in serve.stderr_text()
    before = completions_counted(serve)

    async def one(i: int) -> str:
        async with httpx.AsyncClient(timeout=REQUEST_BOUND_S) as client:  # its own connection
            reply = await client.post(f"{serve.url}/completions", json={
                "model": "tiny", "prompt": f"Request {i}:", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        return reply.headers[HEADER]

    async def send(k: int) -> list[str]:
        semaphore = asyncio.Semaphore(4)

        async def bounded(i: int) -> str:
            async with semaphore:
                return await one(i)

        return await asyncio.gather(*(bounded(i) for i in range(k)))

    served, sent = Counter(), 0
    while len(served) < 2 and sent < 96:  # the kernel picks the process: ask until both
        served.update(asyncio.run(send(16)))
        sent += 16
    assert set(served) == {"0", "1"}, served
    # Summed over the two processes: every request once (the scrape itself is not one).
    assert completions_counted(serve) - before == sent


async def one_stream(serve: ServeProcess, i: int, open_on: Counter) -> tuple[str, str]:
    """(the process that served it, 'ok' or the class of the error it ended with)."""
    where = "?"
    async with openai.AsyncOpenAI(base_url=serve.url, api_key="x", max_retries=0,
                                  timeout=REQUEST_BOUND_S) as client:
        try:
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=f"Story {i}: once upon a time", max_tokens=MAX_TOKENS,
                temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            where = raw.headers[HEADER]
            open_on[where] += 1
            try:
                finish = None
                async for chunk in raw.parse():
                    if chunk.choices:
                        finish = chunk.choices[0].finish_reason or finish
            finally:
                open_on[where] -= 1
        except (openai.APIError, httpx.HTTPError) as exc:
            return where, type(exc).__name__
    return where, "ok" if finish == "length" else f"finish={finish}"


@pytest.mark.soak
def test_a_killed_api_server_fails_only_its_own_streams_and_comes_back(serve, pid_file):
    pids_before = api_server_pids(pid_file)
    killed: list[str] = []

    async def run() -> list[tuple[str, str]]:
        semaphore, open_on, ended = asyncio.Semaphore(CONCURRENCY), Counter(), 0

        async def one(i: int) -> tuple[str, str]:
            nonlocal ended
            async with semaphore:
                outcome = await asyncio.wait_for(one_stream(serve, i, open_on),
                                                 REQUEST_BOUND_S)
            ended += 1
            if ended >= KILL_AFTER and not killed and open_on.most_common(1):
                victim, count = open_on.most_common(1)[0]
                if count > 0:  # the process with streams open right now
                    killed.append(victim)
                    os.kill(pids_before[victim], signal.SIGKILL)
            return outcome

        return await asyncio.gather(*(one(i) for i in range(STREAMS)))

    try:
        outcomes = asyncio.run(run())
    except asyncio.TimeoutError:
        raise AssertionError("a stream hung; the cluster's log:\n"
                             + "".join(serve.log[-80:])) from None
    assert killed, "no stream was open when the kill was due"
    victim = killed[0]
    failed = [(where, what) for where, what in outcomes if what != "ok"]
    print(f"api server {victim} killed; outcomes by process: {Counter(outcomes)}")
    assert failed, outcomes  # the victim's open streams ended...
    # ...and only those ("?": refused before its answer began, a connection the victim
    # had accepted; the survivor answers every request it accepts).
    assert all(where == victim or (where == "?" and what == "APIConnectionError")
               for where, what in failed), outcomes
    assert len(failed) <= CONCURRENCY
    assert all(what in ("APIConnectionError", "RemoteProtocolError", "ReadError",
                        "APIError") for _, what in failed), failed  # errors, not wrong text

    name = f"gateway-api-server-{victim}"
    assert wait_until(lambda: restarts(serve).get(name) == 1, 120, interval=1), restarts(serve)
    assert wait_until(lambda: api_server_pids(pid_file).get(victim) not in
                      (None, pids_before[victim]), 30)
    assert "exited with code -9: restarting it" in serve.stderr_text()
    assert wait_until(lambda: httpx.get(f"{serve.base}/health", timeout=10).status_code == 200,
                      120, interval=1)
    # The restarted process serves: ask until it answers one.
    assert wait_until(lambda: httpx.post(f"{serve.url}/completions", timeout=60, json={
        "model": "tiny", "prompt": "again", "max_tokens": 2}).headers.get(HEADER) == victim,
        120, interval=0.2)
    assert serve.process.poll() is None
