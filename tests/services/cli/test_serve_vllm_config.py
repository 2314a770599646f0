"""One real `pagoda serve --config vllm.yaml`, spoken to with the official `openai` client.

The YAML is what a vLLM user brings (HTTPS, root path, API key from VLLM_API_KEY, an
inline chat template, --max-logprobs, usage options, request and access logs); each
setting is checked by what a client or an operator would observe.
"""

from __future__ import annotations

import json
import ssl
import subprocess

import httpx
import openai
import pytest

from serve_cluster import ServeProcess, wait_until

pytestmark = pytest.mark.extended  # make test-extended

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
API_KEY = "vllm-style-secret"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (key, cert)."""
    folder = tmp_path_factory.mktemp("tls")
    key, cert = str(folder / "key.pem"), str(folder / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return key, cert


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_llama_dir, certificate):
    key, cert = certificate
    config = {"model": tiny_llama_dir, "served-model-name": ["tiny"], "dtype": "float32",
              "max-model-len": 256, "ssl-keyfile": key, "ssl-certfile": cert,
              "root-path": "/proxy", "max-logprobs": 3, "enable-prompt-tokens-details": True,
              "enable-force-include-usage": True, "enable-log-requests": True,
              "uvicorn-log-level": "info", "chat-template": TEMPLATE,
              "generation-config": "vllm"}
    path = tmp_path_factory.mktemp("config") / "vllm.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    serve = ServeProcess(["--config", str(path)], env={"VLLM_API_KEY": API_KEY})
    yield serve, cert
    serve.stop()


def trusting(cert: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cert)


def client(served, api_key: str = API_KEY) -> openai.OpenAI:
    serve, cert = served
    return openai.OpenAI(base_url=serve.url, api_key=api_key, max_retries=0,
                         http_client=httpx.Client(verify=trusting(cert), timeout=60))


def test_https_with_the_api_key_from_vllm_api_key(served):
    serve, _ = served
    assert serve.url.startswith("https://127.0.0.1:")
    with pytest.raises(openai.AuthenticationError):
        client(served, "wrong").models.list()
    assert [m.id for m in client(served).models.list().data] == ["tiny"]


def test_chat_template_and_prompt_tokens_details(served, tiny_llama_dir):
    from pagoda.tokenizer.loader import load_tokenizer

    reply = client(served).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    tokenizer = load_tokenizer(tiny_llama_dir)
    # The inline template from the config rendered the prompt, not the model's own.
    assert reply.usage.prompt_tokens == len(tokenizer.encode("<user>hi<assistant>",
                                                             add_special_tokens=False))
    assert reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_max_logprobs(served):
    chat = client(served).chat.completions
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="maximum allowed, 3"):
        chat.create(model="tiny", messages=messages, max_tokens=2, logprobs=True,
                    top_logprobs=5)
    reply = chat.create(model="tiny", messages=messages, max_tokens=2, logprobs=True,
                        top_logprobs=3)
    assert all(len(t.top_logprobs) == 3 for t in reply.choices[0].logprobs.content)


def test_force_include_usage_ends_every_stream_with_usage(served):
    chunks = list(client(served).completions.create(model="tiny", prompt="a b c", max_tokens=4,
                                                    stream=True))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


def test_root_path_request_log_and_access_log(served):
    serve, cert = served
    docs = httpx.get(serve.url.removesuffix("/v1") + "/docs", verify=trusting(cert), timeout=30)
    assert "/proxy/openapi.json" in docs.text  # links go through the proxy's prefix
    client(served).completions.create(model="tiny", prompt="logged prompt", max_tokens=1)
    log = lambda: "".join(serve.log)  # noqa: E731
    assert wait_until(lambda: "prompt: 'logged prompt'" in log(), 30)
    assert "Received request cmpl-" in log()
    # uvicorn's access line (shown at --uvicorn-log-level info), with the proxy's path.
    assert wait_until(lambda: '"POST /proxy/v1/completions HTTP/1.1" 200' in log(), 30), \
        [line for line in serve.log if "[gateway]" in line][-5:]
