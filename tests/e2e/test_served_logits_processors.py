"""Served custom logits processors: `pagoda serve --logits-processors FQCN` builds the
processor in the gpu-worker, a request's `vllm_xargs` reach it as extra_args (the
banned token disappears from the greedy answer), and `--default-chat-template-kwargs`
is passed to the gateway; a malformed vllm_xargs is a 400 naming it."""

from __future__ import annotations

import pathlib

import httpx
import openai
import pytest
from serve_cluster import ServeProcess, flag_value

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended

CASES = pathlib.Path(__file__).resolve().parent.parent / "entrypoints"


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, redis_server):
    import os

    path = os.pathsep.join(p for p in (str(CASES), os.environ.get("PYTHONPATH", "")) if p)
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
                          "--max-model-len", "512", "--redis-url", redis_server.url,
                          "--disable-log-stats",
                          "--logits-processors", "logits_processors_cases.BanTokenProcessor",
                          "--default-chat-template-kwargs", '{"enable_thinking": false}'],
                         env={"PYTHONPATH": path})
    yield serve
    serve.stop()


def first_tokens(client, **extra) -> list[str]:
    out = client.completions.create(model="tiny", prompt="the cat sat", max_tokens=4,
                                    temperature=0, logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": True,
                                                "ignore_eos": True, **extra})
    return out.choices[0].logprobs.tokens


def test_vllm_xargs_reach_the_workers_processor(cluster):
    assert flag_value(cluster.service_args("gpu-worker"), "--logits-processors") \
        == "logits_processors_cases.BanTokenProcessor"
    client = openai.OpenAI(base_url=cluster.url, api_key="x")
    plain = first_tokens(client)
    banned_id = int(plain[0].split(":")[1])
    banned = first_tokens(client, vllm_xargs={"ban_token_id": banned_id})
    assert plain[0] not in banned
    assert first_tokens(client) == plain  # the ban was that request's alone


def test_a_malformed_vllm_xargs_is_a_400_naming_it(cluster):
    r = httpx.post(f"{cluster.url}/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "max_tokens": 1, "vllm_xargs": {"a": {"nested": 1}}})
    assert r.status_code == 400 and "vllm_xargs" in r.text


def test_default_chat_template_kwargs_reach_the_gateway(cluster):
    assert flag_value(cluster.service_args("gateway"), "--default-chat-template-kwargs") \
        == '{"enable_thinking": false}'
