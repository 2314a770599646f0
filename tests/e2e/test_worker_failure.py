"""A gpu-worker that dies (one replica, so nowhere to migrate): its requests fail with an
error (no hang), and `pagoda serve` restarts the replica -- the worker and its scheduler,
whose engine failed with it -- so that serving resumes."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest
from serve_cluster import ServeProcess, wait_until

pytestmark = pytest.mark.slow


def test_dead_worker_fails_its_requests_and_serve_restarts_the_replica(tiny_llama_dir):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "1024", "--restart-backoff", "0.2"])
    try:
        client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="Tell me a long story",
                                           max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))  # the request is running
        old = {name: serve.service_pid(name) for name in ("gpu-worker", "scheduler")}
        os.kill(old["gpu-worker"], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            for _ in stream:
                pass
        assert time.monotonic() - start < 30
        assert wait_until(lambda: "service 'gpu-worker' exited with code -9: restarting"
                          in serve.stderr_text(), 10)

        def serves() -> bool:
            reply = httpx.post(f"{serve.url}/completions", timeout=30,
                               json={"model": "tiny", "prompt": "again", "max_tokens": 4})
            return reply.status_code == 200

        assert wait_until(serves, 60, interval=0.5)
        assert serve.process.poll() is None
        for name, pid in old.items():
            assert serve.service_pid(name) != pid, name
        counted = {dict(labels)["service"]: value for (name, labels), value
                   in serve.scrape().items() if name == "pagoda_service_restarts_total"}
        assert counted["gpu-worker"] == counted["scheduler"] == 1
        # Every other service was left alone (two tokenizer replicas by default).
        assert counted["tokenizer-0"] == counted["tokenizer-1"] == counted["gateway"] == 0
    finally:
        serve.stop()
