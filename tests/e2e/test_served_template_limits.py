"""The chat-template sandbox's limits are the operator's: `pagoda serve
--chat-template-render-timeout S --chat-template-max-output-chars N` reaches the tokenizer,
whose renders then stop at those limits (a 400 through the gateway), while a cluster
with the defaults renders the same requests."""

from __future__ import annotations

import httpx
import pytest
from serve_cluster import ServeProcess, flag_value

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended

# Runs 10^10 loop iterations unless it is stopped.
SLOW_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                 "{% endfor %}{{ messages[0]['content'] }}")
LONG_MESSAGE = [{"role": "user", "content": "tell me " * 400}]  # 3,200 characters


@pytest.fixture(scope="module")
def limited_cluster(tiny_llama_dir, redis_server):
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "2048", "--redis-url", redis_server.url,
                          "--trust-request-chat-template", "--disable-log-stats",
                          "--chat-template-render-timeout", "0.5",
                          "--chat-template-max-output-chars", "2000"])
    yield serve
    serve.stop()


def chat(serve: ServeProcess, messages, **extra) -> httpx.Response:
    return httpx.post(f"{serve.url}/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 2, **extra})


def test_the_tokenizer_gets_the_limits_and_refuses_past_them(limited_cluster):
    argv = limited_cluster.service_args("tokenizer")
    assert flag_value(argv, "--chat-template-render-timeout") == "0.5"
    assert flag_value(argv, "--chat-template-max-output-chars") == "2000"

    slow = chat(limited_cluster, [{"role": "user", "content": "hi"}],
                chat_template=SLOW_TEMPLATE)
    assert slow.status_code == 400, slow.text
    assert "more than 0.5 s to render" in slow.json()["error"]["message"]

    long = chat(limited_cluster, LONG_MESSAGE)
    assert long.status_code == 400, long.text
    assert "more than 2000 characters" in long.json()["error"]["message"]

    short = chat(limited_cluster, [{"role": "user", "content": "hi"}])
    assert short.status_code == 200, short.text
    assert httpx.get(f"{limited_cluster.base}/health", timeout=10).status_code == 200


def test_the_defaults_render_what_the_small_limits_refuse(tiny_cluster):
    argv = tiny_cluster.service_args("tokenizer")
    assert "--chat-template-render-timeout" not in argv  # the defaults: 5 s, 16 Mi chars
    reply = chat(tiny_cluster, LONG_MESSAGE)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] > 400
