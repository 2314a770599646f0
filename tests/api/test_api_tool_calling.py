"""Tool calling and reasoning through the gateway, with the official openai client.

The scheduler is scripted (it answers every request with the model output a test
sets, then stops, as the model would after its EOS), so the model's real formats can
be played through the whole gateway path: the real tokenizer service decodes the
tokens, the gateway splits reasoning from content and reads the tool calls, streamed
and not. (Tests against a real model: test_api_structured_outputs.py.)
"""

from __future__ import annotations

import json
import time

import openai
import pytest
from api_fakes import FakeScheduler, Gateway, Peers

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services.gateway.serving_options import ServingOptions

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>')
THINKING = "The user wants the weather; I will call the tool.</think>\n\n" + HERMES


class ScriptedScheduler(FakeScheduler):
    """Answers with `script` (token ids), then finishes with "stop"."""

    def Generate(self, request, context):
        self.requests.append(request)
        for token in self.script[:request.sampling_params.max_tokens]:
            yield spb.GenerateResponse(chunk=spb.GenerateChunk(token_ids=[token]))
            time.sleep(0.001)
        yield spb.GenerateResponse(complete=spb.GenerateComplete(
            finish_reason=cpb.FINISH_REASON_STOP))


class ScriptedPeers(Peers):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.stop()  # replace the scheduler server with the scripted one
        self._servers = []
        from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
        from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc

        self.scheduler = ScriptedScheduler(tokenizer)
        self.tokenizer_addr = self._serve(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                          self.tokenizer)
        self.scheduler_addr = self._serve(spb_grpc.add_SchedulerServiceServicer_to_server,
                                          self.scheduler)


@pytest.fixture(scope="module")
def peers(smollm2_tokenizer):
    peers = ScriptedPeers(smollm2_tokenizer)
    yield peers
    peers.stop()


@pytest.fixture(scope="module")
def client(peers):
    gateway = Gateway(peers, options=ServingOptions(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1"))
    yield openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                        timeout=30)
    gateway.stop()


@pytest.fixture
def script(peers, smollm2_tokenizer):
    """script(text): the model's next answers are `text`; returns its token count."""
    def set_script(text: str) -> int:
        peers.scheduler.script = smollm2_tokenizer.encode(text, add_special_tokens=False)
        return len(peers.scheduler.script)
    return set_script


def collect_stream(chunks):
    reasoning, content, calls, finish, usage = "", "", {}, None, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("chatcmpl-tool-") and call.function.name
                    calls[call.index] = {"name": call.function.name, "arguments": ""}
                else:
                    assert call.id is None and call.function.name is None  # the name once
                calls[call.index]["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, usage


def test_auto_tool_calls_after_the_reasoning(client, script):
    num_tokens = script(THINKING)
    reply = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=200)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.reasoning_content == "The user wants the weather; I will call the tool."
    assert message.content == "\n\nLet me check.\n"
    [call] = message.tool_calls
    assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
    assert (call.function.name, json.loads(call.function.arguments)) == \
        ("get_weather", {"city": "Paris"})
    assert reply.usage.completion_tokens == num_tokens

    stream = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                            max_tokens=200, stream=True,
                                            stream_options={"include_usage": True})
    reasoning, content, calls, finish, usage = collect_stream(stream)
    assert (reasoning, content, finish) == (message.reasoning_content, message.content,
                                            "tool_calls")
    assert calls == [{"name": "get_weather", "arguments": call.function.arguments}]
    assert usage.completion_tokens == num_tokens


def test_tool_choice_none_leaves_the_answer_as_text(client, script):
    script("</think>" + HERMES)
    reply = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                           tool_choice="none", max_tokens=200)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == HERMES
    assert reply.choices[0].finish_reason == "stop"


def test_an_answer_without_calls_is_content(client, script):
    script("Short thought.</think>It is sunny in Paris.")
    reply = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                           max_tokens=200)
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content, message.tool_calls) == \
        ("Short thought.", "It is sunny in Paris.", None)
    assert reply.choices[0].finish_reason == "stop"
    _, content, calls, finish, _ = collect_stream(client.chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=200, stream=True))
    assert (content, calls, finish) == ("It is sunny in Paris.", [], "stop")


def test_the_tool_format_keeps_its_special_tokens(client, script, peers):
    """Hermes' markers are added tokens: the decoder must not skip them (vLLM's
    adjust_request), unless the request has no tools to call."""
    script("</think>ok")
    client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                   max_tokens=20)
    assert peers.tokenizer.decode_options[-1].skip_special_tokens is False
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=20)
    assert peers.tokenizer.decode_options[-1].skip_special_tokens is True


def test_assistant_tool_calls_and_tool_results_reach_the_template(client, script, peers):
    script("</think>It is 21 degrees in Paris.")
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    reply = client.chat.completions.create(model="fake-model", messages=history, tools=TOOLS,
                                           max_tokens=50)
    assert reply.choices[0].message.content == "It is 21 degrees in Paris."
    assert reply.usage.prompt_tokens > 0
