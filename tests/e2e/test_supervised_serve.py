"""`pagoda serve` supervises its services like a pod controller: a stateless service
SIGKILLed under load is restarted with its own command line and the cluster serves on;
one that keeps dying ends `pagoda serve` with an error naming it.

Real processes on loopback, the tiny model, the official `openai` client. Load: 48
streamed completions at concurrency 8, the victim killed once 12 of them have ended.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import pytest
from serve_cluster import ServeProcess, wait_until

pytestmark = pytest.mark.slow

NUM_REQUESTS = 48
CONCURRENCY = 8
KILL_AFTER = 12
REQUEST_BOUND_S = 30.0  # detects a hang, not a speed


def start(tiny_llama_dir: str, redis_url: str, *flags: str) -> ServeProcess:
    return ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                         "--max-model-len", "512", "--redis-url", redis_url,
                         "--disable-log-stats", *flags])


@pytest.fixture(scope="module")
def serve(tiny_llama_dir, redis_server):
    # At most 2 restarts a minute: the crash-loop test (last) reaches the limit soon.
    cluster = start(tiny_llama_dir, redis_server.url, "--restart-backoff", "0.2",
                    "--max-restarts", "2")
    yield cluster
    cluster.stop()


def restarts(serve: ServeProcess) -> dict[str, float]:
    return {dict(labels)["service"]: value for (name, labels), value in serve.scrape().items()
            if name == "pagoda_service_restarts_total"}


async def one_stream(client: openai.AsyncOpenAI, i: int) -> str:
    """'ok', or the class of the clean error it ended with (a hang fails the test)."""
    try:
        stream = await client.completions.create(
            model="tiny", prompt=f"Story {i}: once upon a time", max_tokens=24, stream=True,
            extra_body={"ignore_eos": True})
        finish = None
        async for chunk in stream:
            finish = chunk.choices[0].finish_reason or finish if chunk.choices else finish
        return "ok" if finish == "length" else f"finish={finish}"
    except openai.APIError as exc:
        return type(exc).__name__


def load_with_kill(serve: ServeProcess, victim: str) -> tuple[list[str], int]:
    """Run the load, SIGKILLing `victim` once KILL_AFTER requests ended; returns each
    request's outcome and the victim's old pid."""
    pid = serve.service_pid(victim)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=serve.url, api_key="x", max_retries=0,
                                    timeout=REQUEST_BOUND_S)
        semaphore, ended = asyncio.Semaphore(CONCURRENCY), 0

        async def one(i: int) -> str:
            nonlocal ended
            async with semaphore:
                outcome = await asyncio.wait_for(one_stream(client, i), REQUEST_BOUND_S)
            ended += 1
            if ended == KILL_AFTER:
                os.kill(pid, signal.SIGKILL)
            return outcome

        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))

    return asyncio.run(run()), pid


def restarted(serve: ServeProcess, victim: str, old_pid: int) -> bool:
    try:
        return serve.service_pid(victim) != old_pid
    except LookupError:
        return False


def healthy(serve: ServeProcess) -> bool:
    """/health 200 (the gateway polls its peers each second: allow it a few)."""
    return wait_until(lambda: httpx.get(f"{serve.base}/health", timeout=10).status_code == 200,
                      5, interval=0.2)


def serves_again(serve: ServeProcess) -> bool:
    reply = httpx.post(f"{serve.url}/completions", timeout=30,
                       json={"model": "tiny", "prompt": "again", "max_tokens": 4})
    return reply.status_code == 200


def test_a_killed_tokenizer_is_restarted_and_serving_resumes(serve):
    assert restarts(serve).get("tokenizer") == 0  # exported from start-up
    outcomes, old_pid = load_with_kill(serve, "tokenizer")
    # One tokenizer: the requests that needed it while it was down fail, each cleanly
    # (an OpenAI error, no hang); the rest complete.
    failed = [o for o in outcomes if o != "ok"]
    print(f"tokenizer killed: {len(failed)} of {NUM_REQUESTS} failed: {sorted(set(failed))}")
    assert all(o.endswith("Error") for o in failed), failed
    assert outcomes.count("ok") >= KILL_AFTER
    assert wait_until(lambda: restarted(serve, "tokenizer", old_pid), 20)
    assert wait_until(lambda: serves_again(serve), 30, interval=0.5)
    assert serve.process.poll() is None
    assert restarts(serve)["tokenizer"] == 1
    assert healthy(serve)
    assert "service 'tokenizer' exited with code -9: restarting" in serve.stderr_text()


def test_a_killed_kv_cache_manager_is_restarted_and_no_request_fails(serve):
    outcomes, old_pid = load_with_kill(serve, "kv-cache-manager")
    # Not on a request's path: routing falls back to load while it is down.
    assert outcomes == ["ok"] * NUM_REQUESTS, outcomes
    assert wait_until(lambda: restarted(serve, "kv-cache-manager", old_pid), 20)
    assert wait_until(lambda: restarts(serve).get("kv-cache-manager") == 1, 20)
    assert serves_again(serve)
    assert serve.process.poll() is None
    assert healthy(serve)


def test_a_crash_loop_stops_serve_naming_the_service(serve):
    """Last in this module: it ends the shared `pagoda serve`."""
    for _ in range(3):  # at most 2 restarts a minute, whatever earlier tests used
        pid = serve.service_pid("tokenizer")
        os.kill(pid, signal.SIGKILL)
        if not wait_until(lambda: serve.process.poll() is not None
                          or restarted(serve, "tokenizer", pid), 20):
            raise AssertionError("the tokenizer was neither restarted nor reported")
        if serve.process.poll() is not None:
            break
    assert serve.process.wait(30) != 0
    err = serve.stderr_text()
    assert "service 'tokenizer' exited with code -9 after 2 restart(s)" in err
    assert "crash loop; its last log lines" in err
    assert "stopping" in err
