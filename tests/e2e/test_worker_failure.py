"""A gpu-worker that dies: its requests fail with an error (no hang) and `pagoda serve`
stops, naming it."""

from __future__ import annotations

import os
import signal
import time

import openai
import pytest
from serve_cluster import ServeProcess

pytestmark = pytest.mark.slow


def test_dead_worker_fails_requests_and_serve_reports_it(tiny_llama_dir):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "1024"])
    try:
        client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="Tell me a long story",
                                           max_tokens=1000, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))  # the request is running
        os.kill(serve.service_pid("gpu-worker"), signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises((openai.APIError, openai.APIConnectionError)):
            for _ in stream:
                pass
        assert time.monotonic() - start < 30
        code = serve.process.wait(60)
        assert code != 0
        assert "service 'gpu-worker' exited" in serve.stderr_text()
    finally:
        serve.stop()
