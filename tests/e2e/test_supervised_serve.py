"""`pagoda serve` supervises its services like a pod controller: a stateless service
SIGKILLed under load is restarted with its own command line and the cluster serves on;
one that keeps dying ends `pagoda serve` with an error naming it. With two tokenizer
replicas (the default), killing one fails no request: unary calls are retried on the
other, and the streams decoding on the dead one resume there with the same text.

Real processes on loopback, the tiny model, the official `openai` client. Load: 48
greedy streamed completions at concurrency 8, the victim killed once 12 have ended.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal

import httpx
import openai
import psutil
import pytest
from serve_cluster import ServeProcess, flag_value, wait_until

pytestmark = pytest.mark.slow

NUM_REQUESTS = 48
CONCURRENCY = 8
KILL_AFTER = 12
REQUEST_BOUND_S = 30.0  # detects a hang, not a speed


def start(tiny_llama_dir: str, redis_url: str, *flags: str) -> ServeProcess:
    # The gateway decodes on the tokenizer service here (not in its own process, its
    # default where it can read the tokenizer): a killed tokenizer's streams must resume.
    return ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                         "--max-model-len", "512", "--redis-url", redis_url,
                         "--disable-log-stats", *flags],
                        env={"PAGODA_GATEWAY_LOCAL_DETOKENIZE": "0"})


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


PROMPTS = [f"Story {i}: once upon a time in a land of" for i in range(4)]
MAX_TOKENS = 24


def reference_texts(serve: ServeProcess) -> list[str]:
    """Each prompt's greedy text before anything goes wrong."""
    client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=60)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS,
                                      temperature=0.0, extra_body={"ignore_eos": True}
                                      ).choices[0].text for p in PROMPTS]


async def one_stream(client: openai.AsyncOpenAI, i: int, expected: list[str]) -> str:
    """'ok' (its text equal to the prompt's reference), or what went wrong: the class
    of the clean error it ended with, or 'wrong text' (a hang fails the test)."""
    try:
        stream = await client.completions.create(
            model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        finish, text = None, []
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
    except openai.APIError as exc:
        return type(exc).__name__
    if finish != "length":
        return f"finish={finish}"
    return "ok" if "".join(text) == expected[i % len(PROMPTS)] else "wrong text"


def load_with_kill(serve: ServeProcess, pid: int) -> list[str]:
    """Run the load, SIGKILLing `pid` once KILL_AFTER requests ended; returns each
    request's outcome."""
    expected = reference_texts(serve)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=serve.url, api_key="x", max_retries=0,
                                    timeout=REQUEST_BOUND_S)
        semaphore, ended = asyncio.Semaphore(CONCURRENCY), 0

        async def one(i: int) -> str:
            nonlocal ended
            async with semaphore:
                outcome = await asyncio.wait_for(one_stream(client, i, expected),
                                                 REQUEST_BOUND_S)
            ended += 1
            if ended == KILL_AFTER:
                os.kill(pid, signal.SIGKILL)
            return outcome

        return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))

    try:
        return asyncio.run(run())
    except asyncio.TimeoutError:
        raise AssertionError("a request hung; the cluster's log:\n"
                             + "".join(serve.log[-80:])) from None


def pid_on_port(serve: ServeProcess, kind: str, port: str) -> int | None:
    """The pid of the `kind` service listening on `port` (None while there is none)."""
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if kind in argv and "--port" in argv and flag_value(argv, "--port") == port:
            return child.pid
    return None


def decode_stream_holder(serve: ServeProcess) -> tuple[int, str]:
    """The tokenizer the gateway's decode stream is on (the one that decoded tokens): its
    pid and port. Killing it is the hard case: its streams must move."""
    decoded = {dict(labels)["instance"]: value for (name, labels), value in serve.scrape().items()
               if name == "pagoda_tokenizer_tokens_total"
               and dict(labels).get("operation") == "DecodeStream" and value > 0}
    assert len(decoded) == 1, decoded
    metrics_port = next(iter(decoded)).rsplit(":", 1)[1]
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        argv = child.cmdline()
        if "tokenizer" in argv and flag_value(argv, "--metrics-port") == metrics_port:
            return child.pid, flag_value(argv, "--port")
    raise LookupError(metrics_port)


def victim(serve: ServeProcess, kind: str) -> tuple[int, str]:
    """A `kind` service's pid and port."""
    pid = serve.service_pid(kind)
    return pid, flag_value(psutil.Process(pid).cmdline(), "--port")


def restarted(serve: ServeProcess, kind: str, port: str, old_pid: int) -> bool:
    return pid_on_port(serve, kind, port) not in (None, old_pid)


def healthy(serve: ServeProcess) -> bool:
    """/health 200 (the gateway polls its peers each second: allow it a few)."""
    return wait_until(lambda: httpx.get(f"{serve.base}/health", timeout=10).status_code == 200,
                      5, interval=0.2)


def serves_again(serve: ServeProcess) -> bool:
    reply = httpx.post(f"{serve.url}/completions", timeout=30,
                       json={"model": "tiny", "prompt": "again", "max_tokens": 4})
    return reply.status_code == 200


def test_a_killed_tokenizer_fails_no_request_and_is_restarted(serve):
    assert restarts(serve) == {"kv-cache-manager": 0, "tokenizer-0": 0, "tokenizer-1": 0,
                               "gpu-worker": 0, "scheduler": 0, "gateway": 0}  # from start-up
    reference_texts(serve)  # opens the decode stream
    pid, port = decode_stream_holder(serve)
    outcomes = load_with_kill(serve, pid)
    assert outcomes == ["ok"] * NUM_REQUESTS, outcomes
    assert "resuming from" in serve.stderr_text()  # streams moved to the other tokenizer
    assert wait_until(lambda: restarted(serve, "tokenizer", port, pid), 20)
    assert serves_again(serve)
    assert serve.process.poll() is None
    counted = restarts(serve)
    assert counted["tokenizer-0"] + counted["tokenizer-1"] == 1, counted
    assert healthy(serve)
    assert "exited with code -9: restarting" in serve.stderr_text()


def test_a_killed_kv_cache_manager_is_restarted_and_no_request_fails(serve):
    pid, port = victim(serve, "kv-cache-manager")
    outcomes = load_with_kill(serve, pid)
    # Not on a request's path: routing falls back to load while it is down.
    assert outcomes == ["ok"] * NUM_REQUESTS, outcomes
    assert wait_until(lambda: restarted(serve, "kv-cache-manager", port, pid), 20)
    assert wait_until(lambda: restarts(serve).get("kv-cache-manager") == 1, 20)
    assert serves_again(serve)
    assert serve.process.poll() is None
    assert healthy(serve)


def test_a_crash_loop_stops_serve_naming_the_service(serve):
    """Last in this module: it ends the shared `pagoda serve`."""
    _, port = victim(serve, "tokenizer")
    for _ in range(3):  # at most 2 restarts a minute, whatever earlier tests used
        # Waited for: a process in the middle of its exec (the parent-death wrapper
        # becoming the service) has no readable command line for a moment.
        pid = wait_until(lambda: pid_on_port(serve, "tokenizer", port), 20)
        if pid is None:
            raise AssertionError(f"no tokenizer on port {port}; the cluster's log:\n"
                                 + "".join(serve.log[-80:]))
        os.kill(pid, signal.SIGKILL)
        if not wait_until(lambda: serve.process.poll() is not None
                          or restarted(serve, "tokenizer", port, pid), 20):
            raise AssertionError("the tokenizer was neither restarted nor reported")
        if serve.process.poll() is not None:
            break
    assert serve.process.wait(30) != 0
    err = serve.stderr_text()
    assert re.search(r"service 'tokenizer-\d' exited with code -9 after 2 restart\(s\)", err)
    assert "crash loop; its last log lines" in err
    assert "stopping" in err
