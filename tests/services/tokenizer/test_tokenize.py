"""The tokenizer's `Tokenize`: block hashes come with the tokens (equal to the
scheduler's for the same prompt, salt and seed), and typed chat messages and tools
reach the chat template as the client sent them."""

from __future__ import annotations

import copy
import json
import re

import grpc
import pytest

from pagoda.core.request import Request
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.services.common.protocol.tokenizer import chat_input_from_proto, chat_input_to_proto
from pagoda.services.tokenizer.servicer import TokenizerServicer

SEED = "tokenize-test-seed"
TEXT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def stub(smollm2_tokenizer, grpc_server_factory_module):
    servicer = TokenizerServicer(smollm2_tokenizer, "smollm2", [2], prefix_hash_seed=SEED)
    served = grpc_server_factory_module(pb_grpc.add_TokenizerServiceServicer_to_server, servicer)
    return pb_grpc.TokenizerServiceStub(served.channel)


def engine_hashes(token_ids: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """What a scheduler's engine computes for the same prompt."""
    core = EngineCoreRequest("r", token_ids, SamplingParams(), cache_salt=salt)
    return Request(core, block_size, SEED, max_model_len=len(token_ids) + 1).block_hashes


@pytest.mark.parametrize("salt", ["", "tenant-7"])
def test_tokenize_returns_the_schedulers_block_hashes(stub, salt):
    reply = stub.Tokenize(pb.TokenizeRequest(prompt=TEXT, add_special_tokens=True, block_size=4,
                                             cache_salt=salt))
    ids = list(reply.token_ids)
    assert len(ids) >= 12 and list(reply.block_hashes) == engine_hashes(ids, 4, salt or None)
    assert len(reply.block_hashes) == len(ids) // 4  # full blocks only
    # A prompt sent as token ids is hashed alike, without being encoded.
    by_ids = stub.Tokenize(pb.TokenizeRequest(token_ids=pb.TokenIds(token_ids=ids), block_size=4,
                                              cache_salt=salt))
    assert list(by_ids.token_ids) == ids and by_ids.block_hashes == reply.block_hashes


def test_tokenize_hashes_chat_prompts_and_only_when_asked(stub):
    chat = chat_input_to_proto([{"role": "user", "content": TEXT}], True, False)
    reply = stub.Tokenize(pb.TokenizeRequest(chat=chat, block_size=16))
    assert list(reply.block_hashes) == engine_hashes(list(reply.token_ids), 16, None)
    assert not stub.Tokenize(pb.TokenizeRequest(chat=chat)).block_hashes  # block_size 0
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(prompt=TEXT, block_size=-1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"},
                                  "days": {"type": "integer", "minimum": 1, "default": 3}}}}}]
MESSAGES = [
    {"role": "system", "content": "Be brief.", "name": "ops"},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "call-1"},
]
# Renders every field the typed messages carry, in the order it arrives.
TEMPLATE = ("{% for t in tools %}{{ t.function.name }}:{{ t.function.description }}:"
            "{{ t.function.parameters | tojson }};{% endfor %}"
            "{% for m in messages %}[{{ m.role }}|{{ m.name }}|{{ m.content }}|{{ m.tool_call_id }}"
            "{% for c in m.tool_calls or [] %}|{{ c.id }} {{ c.type }} {{ c.function.name }} "
            "{{ c.function.arguments | tojson }}{% endfor %}]{% endfor %}{{ depth }}")


def test_typed_chat_messages_and_tools_reach_the_template_unchanged(stub, smollm2_tokenizer):
    kwargs = {"chat_template": TEMPLATE, "depth": 3}
    chat = chat_input_to_proto(MESSAGES, False, False, kwargs, TOOLS)
    reply = stub.Tokenize(pb.TokenizeRequest(chat=chat))
    # vLLM's rule: the template sees a call's arguments as the object they encode.
    as_objects = copy.deepcopy(MESSAGES)
    for call in as_objects[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    expected = smollm2_tokenizer.apply_chat_template(as_objects, tools=TOOLS, tokenize=False,
                                                     add_generation_prompt=False, **kwargs)
    assert reply.prompt == expected
    assert '{"type": "object", "required": ["city"]' in expected  # key order kept
    assert "|call-1 function get_weather {\"city\": \"Paris\"}]" in expected and expected[-1] == "3"
    back = chat_input_from_proto(pb.ChatInput.FromString(chat.SerializeToString()))
    assert back["messages"] == MESSAGES and back["tools"] == TOOLS
    assert back["chat_template_kwargs"] == kwargs


def test_a_requests_tool_call_arguments_are_parsed_once(stub, monkeypatch):
    """Gateway (chat_input) -> wire -> tokenizer -> template: the client's JSON string is
    parsed once, where the template reads it; invalid JSON is still the request's 400
    (the tokenizer's INVALID_ARGUMENT) naming the field."""
    from pagoda.services.gateway.openai.routes import chat_input  # lazy: gateway code, one test
    arguments = MESSAGES[2]["tool_calls"][0]["function"]["arguments"]
    parsed = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **k: (
        parsed.append(1) if text == arguments else None, loads(text, *a, **k))[1])
    _, chat = chat_input(copy.deepcopy(MESSAGES), False, False, {"chat_template": TEMPLATE},
                         TOOLS)
    reply = stub.Tokenize(pb.TokenizeRequest(chat=chat))
    assert '{"city": "Paris"}' in reply.prompt
    assert len(parsed) == 1
    bad = copy.deepcopy(MESSAGES)
    bad[2]["tool_calls"][0]["function"]["arguments"] = "{oops"
    _, chat = chat_input(bad, False, False, {"chat_template": TEMPLATE}, TOOLS)
    with pytest.raises(grpc.RpcError) as info:
        stub.Tokenize(pb.TokenizeRequest(chat=chat))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(
        "messages[2].tool_calls[0].function.arguments is not valid JSON")


@pytest.mark.parametrize("messages, tools, kwargs, where", [
    ([{"role": "user", "content": "x", "name": 3}], None, None, "messages[0].name"),
    ([{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "function": "f"}]}],
     None, None, "messages[0].tool_calls[0].function"),
    ([{"role": "user", "content": "x"}], [{"type": "function", "function": {"name": 1}}], None,
     "tools[0].function.name"),
    ([{"role": "user", "content": "x"}], None, {"x": 10**400}, "chat_template_kwargs"),
])
def test_invalid_typed_fields_name_the_field(messages, tools, kwargs, where):
    with pytest.raises(ValueError, match="^" + re.escape(where)):
        chat_input_to_proto(messages, True, False, kwargs, tools)
