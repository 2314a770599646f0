"""The tokenizer service for a gpt-oss model: chats are rendered in the harmony format
(not with the chat template, as vLLM renders them), the reply names the format's stop
tokens, an assistant's `reasoning` survives the wire, and a chat the format cannot take
(a tool result without its call, a tokenizer without the control tokens) is the
request's error (INVALID_ARGUMENT: the gateway's 400)."""

from __future__ import annotations

import copy
import logging

import grpc
import pytest

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
from pagoda.services.common.protocol.tokenizer import chat_input_to_proto
from pagoda.services.tokenizer.server import use_harmony
from pagoda.services.tokenizer.servicer import TokenizerServicer
from pagoda.tokenizer.harmony import CONTROL_TOKENS, encode_harmony, harmony_segments

DATE = "2025-06-28"
MESSAGES = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "reasoning": "Call it.",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "weather", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]


class _Aborted(Exception):
    pass


class _Context:
    def abort(self, code, details):
        raise _Aborted(code, details)


@pytest.fixture
def harmony_tokenizer(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(CONTROL_TOKENS)})
    return tokenizer


def servicer_for(tokenizer, harmony: bool = True) -> TokenizerServicer:
    servicer = TokenizerServicer(tokenizer, "gpt-oss", [2])
    servicer.harmony = harmony
    return servicer


def tokenize(servicer, messages, **kwargs) -> pb.TokenizeResponse:
    chat = chat_input_to_proto(messages, True, False, **kwargs)
    return servicer.Tokenize(pb.TokenizeRequest(chat=chat), _Context())


def test_a_gpt_oss_chat_is_harmony_with_its_stop_tokens(harmony_tokenizer, monkeypatch):
    monkeypatch.setenv("PAGODA_SYSTEM_START_DATE", DATE)
    reply = tokenize(servicer_for(harmony_tokenizer), MESSAGES,
                     chat_template_kwargs={"reasoning_effort": "high"})
    segments = harmony_segments(MESSAGES, None, "high", current_date=DATE)
    assert list(reply.token_ids) == encode_harmony(harmony_tokenizer, segments)
    assert "<|channel|>analysis<|message|>Call it.<|end|>" in reply.prompt  # reasoning kept
    assert list(reply.chat_stop_token_ids) == harmony_tokenizer.convert_tokens_to_ids(
        ["<|return|>", "<|call|>"])
    # another model's chat: the template renders it, no stop tokens of its own
    plain = tokenize(servicer_for(harmony_tokenizer, harmony=False), MESSAGES[:1])
    assert "<|start|>" not in plain.prompt and not plain.chat_stop_token_ids


def test_what_harmony_cannot_take_is_the_requests_error(harmony_tokenizer, smollm2_tokenizer):
    with pytest.raises(_Aborted) as info:
        tokenize(servicer_for(harmony_tokenizer), [MESSAGES[0], MESSAGES[2]])
    assert info.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "tool_call_id 'c1'" in info.value.args[1]
    with pytest.raises(_Aborted, match="no single token for the harmony control token"):
        tokenize(servicer_for(smollm2_tokenizer), MESSAGES[:1])


def test_gpt_oss_is_detected_and_chat_template_is_not_used(harmony_tokenizer, caplog):
    assert not use_harmony("LlamaForCausalLM", harmony_tokenizer, None)
    with caplog.at_level(logging.WARNING):
        assert use_harmony("GptOssForCausalLM", harmony_tokenizer, "{{ 'x' }}")
    assert "--chat-template is not used" in caplog.text
