"""The default model (SmolLM2-135M-Instruct GGUF) served by `pagoda serve` with no Redis URL
(a private Redis is started and stopped with it)."""

from __future__ import annotations

import openai
import psutil
import pytest
from serve_cluster import ServeProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_cluster():
    serve = ServeProcess(["--max-model-len", "2048"], timeout=300)
    children = psutil.Process(serve.process.pid).children(recursive=True)
    yield serve
    assert serve.stop() == 0
    # Every service and the private Redis are gone.
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_chat_answers_and_streams_the_same_text(smollm2_cluster):
    client = openai.OpenAI(base_url=smollm2_cluster.url, api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                           temperature=0.0, max_tokens=40)
    assert "Paris" in whole.choices[0].message.content
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0.0, max_tokens=40,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completion_with_stop_string(smollm2_cluster):
    client = openai.OpenAI(base_url=smollm2_cluster.url, api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Count: 1, 2, 3,",
                                    temperature=0.0, max_tokens=30, stop=[" 6"])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text.startswith(" 4, 5,") and "6" not in out.choices[0].text
