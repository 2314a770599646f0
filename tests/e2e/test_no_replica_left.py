"""One model replica (`make run`'s shape), and it dies or freezes mid-stream: with no
replica to migrate to, every open stream ends with a clean error in OpenAI's JSON
within seconds (never a hang), a new request is a 503 while the replica is away, and
the restarted replica serves again.

Soak (`make test-chaos`): a cluster start and a replica restart per case (~1 min each).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest
from serve_cluster import ServeProcess, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.soak]

STREAMS = 8
# A stream that has not ended this long after the strike hangs (the keepalive and
# step deadlines end a frozen replica's streams in ~10 s here).
HANG_BOUND_S = 90.0


def stream(url: str, i: int, out: dict) -> None:
    body = {"model": "tiny", "prompt": f"story {i}", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    result: dict = {"tokens": 0, "errors": [], "finish": None}
    out[i] = result  # updated as tokens arrive
    try:
        with httpx.stream("POST", f"{url}/completions", json=body, timeout=HANG_BOUND_S * 2
                          ) as reply:
            result["status"] = reply.status_code
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result["errors"].append(event["error"])
                    continue
                for choice in event["choices"]:
                    result["tokens"] += 1
                    result["finish"] = choice["finish_reason"] or result["finish"]
    except httpx.HTTPError as exc:
        result["errors"].append(repr(exc))
    result["ended"] = time.monotonic()


def victim_pid(serve: ServeProcess, kind: str) -> int:
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        if kind in child.cmdline():
            return child.pid
    raise AssertionError(f"no {kind} process")


@pytest.mark.parametrize("victim,fault", [("scheduler", "SIGKILL"), ("gpu-worker", "SIGSTOP")])
def test_the_only_replica_lost_mid_stream_ends_every_stream_cleanly(tiny_llama_dir, victim,
                                                                     fault):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "512", "--restart-backoff", "0.5"])
    try:
        results: dict[int, dict] = {}
        threads = [threading.Thread(target=stream, args=(serve.url, i, results), daemon=True)
                   for i in range(STREAMS)]
        for thread in threads:
            thread.start()
        # Every stream has streamed (so each is the replica's to lose, not to refuse).
        assert wait_until(lambda: len(results) == STREAMS
                          and all(r["tokens"] > 0 for r in results.values()), 60), results
        pid = victim_pid(serve, victim)
        struck = time.monotonic()
        os.kill(pid, getattr(signal, fault))
        for thread in threads:
            thread.join(max(HANG_BOUND_S - (time.monotonic() - struck), 1))
        assert not any(t.is_alive() for t in threads), "a stream hung with no replica left"
        for i, result in results.items():
            # Each ended early, with the replica's error in OpenAI's JSON, not a finish.
            assert result["finish"] is None, (i, result)
            assert result["errors"] and isinstance(result["errors"][0], dict), (i, result)
            assert result["errors"][0]["code"] == 503, (i, result)
        if fault == "SIGSTOP":
            try:
                os.kill(pid, signal.SIGCONT)  # if the supervisor has not replaced it yet
            except ProcessLookupError:
                pass
        # The replica restarts (a unit: scheduler and gpu-worker) and serves again.
        assert wait_until(lambda: httpx.get(f"{serve.base}/health", timeout=10).status_code
                          == 200, 120, interval=0.5), "the restarted replica never served"
        reply = httpx.post(f"{serve.url}/completions", timeout=60,
                           json={"model": "tiny", "prompt": "again", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        serve.stop()
