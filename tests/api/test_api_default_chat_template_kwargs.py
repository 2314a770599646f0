"""vLLM's --default-chat-template-kwargs: every chat request's template gets them,
under the request's own chat_template_kwargs (key by key); a bad flag fails start-up."""

from __future__ import annotations

import argparse

import httpx
import pytest
from api_fakes import Gateway

from pagoda.services.gateway.serving_options import ServingOptions, add_serving_args

TEMPLATE = "[{{ persona }}|{{ mood }}]{% for m in messages %}{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def gateway(fake_peers):
    options = ServingOptions(trust_request_chat_template=True,
                             default_chat_template_kwargs={"persona": "pirate", "mood": "calm"})
    gw = Gateway(fake_peers, options=options)
    yield gw
    gw.stop()


def rendered(gw, kwargs: dict | None) -> str:
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
            "chat_template": TEMPLATE, "add_generation_prompt": False}
    if kwargs is not None:
        body["chat_template_kwargs"] = kwargs
    r = httpx.post(f"{gw.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return httpx.post(f"{gw.url}/detokenize", json={"tokens": r.json()["tokens"]},
                      timeout=30).json()["prompt"]


def test_defaults_apply_and_the_request_overrides_them_key_by_key(gateway):
    assert rendered(gateway, None) == "[pirate|calm]hi"
    assert rendered(gateway, {"mood": "stormy"}) == "[pirate|stormy]hi"


def test_the_flag_is_parsed_as_a_json_object():
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    args = parser.parse_args(["--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert ServingOptions.from_args(args).default_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match="--default-chat-template-kwargs"):
        ServingOptions.from_args(parser.parse_args(["--default-chat-template-kwargs", "[1]"]))
