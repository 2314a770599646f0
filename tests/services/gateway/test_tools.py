"""tools / tool_choice / parallel_tool_calls -> a plan, or a 400 naming the field."""

from __future__ import annotations

import pytest

from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.request_models import ChatCompletionRequest
from pagoda.services.gateway.openai.tools import AUTO_NEEDS_FLAGS, plan_tools

MESSAGES = [{"role": "user", "content": "hi"}]
DEFS = {"Unit": {"enum": ["c", "f"]}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city"], "$defs": DEFS}}}
NOW = {"type": "function", "function": {"name": "now"}}


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=MESSAGES, **fields)


def test_no_tool_choice_means_auto_with_a_parser_and_none_without():
    assert plan_tools(body(tools=[WEATHER]), "hermes").mode == "auto"
    plan = plan_tools(body(tools=[WEATHER]), None)
    assert plan.mode == "none" and plan.parser is None and plan.constraint is None


def test_required_builds_one_schema_of_every_tool():
    plan = plan_tools(body(tools=[WEATHER, NOW], tool_choice="required"), None)
    schema = plan.constraint["json"]
    assert plan.mode == "required" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["now"]]
    assert schema["$defs"] == DEFS  # lifted to the root, where "#/$defs/Unit" points
    single = plan_tools(body(tools=[WEATHER], tool_choice="required",
                             parallel_tool_calls=False), None)
    assert single.constraint["json"]["maxItems"] == 1


def test_a_named_function_is_constrained_to_its_own_parameters():
    plan = plan_tools(body(tools=[WEATHER, NOW], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), None)
    assert plan.mode == "named" and plan.constraint["json"]["required"] == ["city"]
    assert body(tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}).to_sampling_params(8, 100).structured_outputs.kind == "json"


@pytest.mark.parametrize("fields, message", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "'nope', which is not in tools (get_weather)"),
    (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     "but the request has no tools"),
    (dict(tool_choice="required"), 'tool_choice "required" needs tools'),
    (dict(tools=[WEATHER], tool_choice="auto"), AUTO_NEEDS_FLAGS),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "got 'sometimes'"),
    (dict(tools=[{"type": "function"}]), "tools[0].function must be an object"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]),
     "tools[0].function.name must be 1-64 letters"),
    (dict(tools=[{"type": "retrieval"}]), "tools[0] must be a function tool"),
    (dict(tools=[WEATHER, WEATHER]), "'get_weather' is used by another tool"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
     "parameters must be a JSON schema object"),
])
def test_malformed_tools_and_choices_are_400s(fields, message):
    with pytest.raises(APIError) as info:
        plan_tools(body(**fields), None)
    assert info.value.status == 400 and message in info.value.message
    assert info.value.param in ("tools", "tool_choice")


def test_a_forced_choice_and_response_format_together_are_refused():
    with pytest.raises(APIError, match="got response_format and tool_choice"):
        body(tools=[WEATHER], tool_choice="required",
             response_format={"type": "json_object"}).check_common()


def test_auto_without_parallel_tool_calls_keeps_the_first_call():
    plan = plan_tools(body(tools=[WEATHER, NOW], parallel_tool_calls=False), "hermes")
    text = ('<tool_call>{"name": "now", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    assert [c.name for c in plan.parser.parse(text, final=True).calls] == ["now"]
    assert plan.parser.keeps_special_tokens
