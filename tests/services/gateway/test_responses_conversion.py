"""The Responses API's conversions, without a server: input items -> chat messages,
tools and tool_choice -> chat's, and chat answer deltas -> output items and events."""

import pytest

from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.responses_api.input_items import (chat_tool_choice,
                                                                      chat_tools, input_messages)
from pagoda.services.gateway.openai.responses_api.output_items import OutputBuilder


def call(call_id: str, name: str = "f", arguments: str = "{}") -> dict:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def test_calls_share_the_assistant_turn_and_outputs_become_tool_messages():
    messages = input_messages([
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        call("c1", arguments='{"a": 1}'), call("c2", name="g"),
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]}])
    assert messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a": 1}'}},
                        {"id": "c2", "type": "function",
                         "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"}]


def test_an_output_may_answer_a_call_of_the_stored_conversation_only():
    history = [{"role": "assistant", "content": None,
                "tool_calls": [{"id": "c9", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]}]
    item = {"type": "function_call_output", "call_id": "c9", "output": "x"}
    assert input_messages([item], history)[0]["tool_call_id"] == "c9"
    with pytest.raises(APIError, match="c9") as caught:
        input_messages([item])
    assert caught.value.param == "input"


def test_tools_and_tool_choice_take_chats_shape():
    tool = {"type": "function", "name": "f", "description": "d", "strict": True,
            "parameters": {"type": "object"}}
    assert chat_tools([tool]) == [{"type": "function", "function": {
        "name": "f", "description": "d", "parameters": {"type": "object"}}}]
    assert chat_tools([]) is None
    assert chat_tool_choice({"type": "function", "name": "f"}, True) == \
        {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("auto", False) is None  # unset: chat's default applies
    assert chat_tool_choice("required", True) == "required"
    for bad, param in (([{"type": "web_search"}], "tools"),
                       ([tool] * 129, "tools")):
        with pytest.raises(APIError) as caught:
            chat_tools(bad)
        assert caught.value.param == param
    with pytest.raises(APIError) as caught:
        chat_tool_choice({"type": "mcp"}, True)
    assert caught.value.param == "tool_choice"


def test_deltas_become_items_in_order_with_their_events():
    out = OutputBuilder()
    out.feed([{"reasoning": "hm", "reasoning_content": "hm"}])
    out.feed([{"reasoning": "m", "reasoning_content": "m"}, {"content": "Let me"}])
    out.feed([{"content": " check."}])
    out.feed([{"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                               "function": {"name": "f", "arguments": ""}}]}])
    out.feed([{"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}])
    out.feed([{"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]}])
    out.finish("completed")
    kinds = [kind for kind, _ in out.drain()]
    assert kinds == [
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    reasoning, message, function_call = out.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "Let me check." == out.text
    assert (function_call["call_id"], function_call["name"], function_call["arguments"],
            function_call["status"]) == ("call_1", "f", '{"a": 1}', "completed")
    assert out.assistant_message() == {"role": "assistant", "content": "Let me check.",
                                       "tool_calls": [{"id": "call_1", "type": "function",
                                                       "function": {"name": "f",
                                                                    "arguments": '{"a": 1}'}}]}


def test_an_answer_cut_by_max_output_tokens_leaves_its_item_incomplete():
    out = OutputBuilder()
    out.feed([{"content": "partial"}])
    out.finish("incomplete")
    assert out.items[0]["status"] == "incomplete"
    assert out.drain()[-1][1]["item"]["status"] == "incomplete"
    empty = OutputBuilder()
    empty.finish("completed")
    assert [(i["type"], i["content"][0]["text"]) for i in empty.items] == [("message", "")]
    assert empty.assistant_message() == {"role": "assistant", "content": ""}
