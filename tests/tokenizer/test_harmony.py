"""The harmony renderer (pagoda.tokenizer.harmony) against the public harmony guide's
own examples, written out by hand: the system and developer messages, function tools
in TypeScript, a tool-call round trip, earlier turns' reasoning dropped, the effort.

The guide's examples join messages directly (`<|end|><|start|>`); the expected
strings below are the guide's text with its date (2025-06-28)."""

from __future__ import annotations

import pytest

from pagoda.tokenizer.harmony import (CONTROL_TOKENS, encode_harmony, harmony_segments,
                                      render_harmony, stop_token_ids)
from pagoda.tokenizer.harmony_schema import schema_to_typescript

DATE = "2025-06-28"

SYSTEM_TOOLS = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\nReasoning: high\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>")

# The guide's developer message with its three functions ("Function calling").
DEVELOPER_TOOLS = """<|start|>developer<|message|># Instructions

Use a friendly tone.

# Tools

## functions

namespace functions {

// Gets the location of the user.
type get_location = () => any;

// Gets the current weather in the provided location.
type get_current_weather = (_: {
// The city and state, e.g. San Francisco, CA
location: string,
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

// Gets the current weather in the provided list of locations.
type get_multiple_weathers = (_: {
// List of city and state, e.g. ["San Francisco, CA", "New York, NY"]
locations: string[],
format?: "celsius" | "fahrenheit", // default: celsius
}) => any;

} // namespace functions<|end|>"""

FORMAT = {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}
TOOLS = [
    {"type": "function", "function": {"name": "get_location",
                                      "description": "Gets the location of the user."}},
    {"type": "function", "function": {
        "name": "get_current_weather",
        "description": "Gets the current weather in the provided location.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string",
                         "description": "The city and state, e.g. San Francisco, CA"},
            "format": FORMAT}, "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "get_multiple_weathers",
        "description": "Gets the current weather in the provided list of locations.",
        "parameters": {"type": "object", "properties": {
            "locations": {"type": "array", "items": {"type": "string"},
                          "description": 'List of city and state, e.g. ["San Francisco, CA", '
                                         '"New York, NY"]'},
            "format": FORMAT}, "required": ["locations"]}}},
]


def system(effort: str = "medium") -> str:
    """The guide's basic system message (no function tools)."""
    return ("<|start|>system<|message|>You are ChatGPT, a large language model trained by "
            "OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: 2025-06-28\n\n"
            f"Reasoning: {effort}\n\n# Valid channels: analysis, commentary, final. Channel "
            "must be included for every message.<|end|>")


def render(messages, **kwargs) -> str:
    return render_harmony(messages, current_date=DATE, **kwargs)


def test_the_guides_basic_chat_system_developer_user():
    messages = [{"role": "system", "content": "Always respond in riddles"},
                {"role": "user", "content": "What is 2 + 2?"}]
    assert render(messages) == (
        system() + "<|start|>developer<|message|># Instructions\n\nAlways respond in riddles"
        "<|end|><|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")
    # no instructions and no tools: no developer message at all (vLLM's preamble)
    assert render(messages[1:]) == (
        system() + "<|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant")


def test_the_guides_function_definitions():
    messages = [{"role": "developer", "content": "Use a friendly tone."},
                {"role": "user", "content": "What is the weather like in SF?"}]
    assert render(messages, tools=TOOLS, reasoning_effort="high") == (
        SYSTEM_TOOLS + DEVELOPER_TOOLS
        + "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant")


def test_a_tool_call_round_trip_keeps_its_reasoning():
    """The guide's "Handling tool calls" prompt: the call's chain of thought stays (no
    final answer follows it yet); the result names the function through the call id.
    The call header is vLLM's (`commentary json`, no <|constrain|>)."""
    messages = [
        {"role": "developer", "content": "Use a friendly tone."},
        {"role": "user", "content": "What is the weather like in SF?"},
        {"role": "assistant", "content": None, "reasoning": "Need to use function get_weather.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"location":"San Francisco"}'}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": '{"sunny": true, "temperature": 20}'},
    ]
    assert render(messages, tools=TOOLS, reasoning_effort="high") == (
        SYSTEM_TOOLS + DEVELOPER_TOOLS
        + "<|start|>user<|message|>What is the weather like in SF?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need to use function get_weather."
        "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"location":"San Francisco"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary"
        '<|message|>{"sunny": true, "temperature": 20}<|end|><|start|>assistant')


def test_earlier_turns_reasoning_is_dropped_after_a_final_answer():
    """The guide's "Handling reasoning output in subsequent sampling" (the stored turn
    ends in <|end|>, as its implementation note says)."""
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4.",
         "reasoning_content": 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'},
        {"role": "user", "content": "What about 9 / 2?"},
    ]
    assert render(messages) == (
        system() + "<|start|>user<|message|>What is 2 + 2?<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|>"
        "<|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant")


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_reasoning_effort_is_the_system_messages(effort):
    messages = [{"role": "user", "content": "Hi"}]
    assert render(messages, reasoning_effort=effort) == (
        system(effort) + "<|start|>user<|message|>Hi<|end|><|start|>assistant")


def test_default_effort_is_medium_and_a_bad_one_is_refused():
    assert "Reasoning: medium" in render([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="reasoning_effort='none'"):
        render([{"role": "user", "content": "Hi"}], reasoning_effort="none")


def test_a_tool_result_without_its_call_is_refused():
    with pytest.raises(ValueError, match=r"messages\[1\].tool_call_id 'call_9'"):
        render([{"role": "user", "content": "Hi"},
                {"role": "tool", "tool_call_id": "call_9", "content": "20"}])


def test_nested_objects_one_of_and_nullable_render_as_the_reference_does():
    schema = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer", "default": 3},
        "b": {"type": "object", "properties": {"c": {"type": ["string", "integer"]}}},
        "d": {"description": "Either", "oneOf": [{"type": "string"},
                                                 {"type": "number", "description": "n"}]},
        "e": {"type": "boolean", "nullable": True, "title": "E"},
    }}
    assert schema_to_typescript(schema) == (
        "{\na: number, // default: 3\nb?: {\n    c?: string | number,\n    },\n"
        "// Either\nd?:\n | string\n | number // n\n,\n// E\n//\ne?: boolean | null,\n}")


def test_control_tokens_are_single_ids_and_text_look_alikes_are_not(smollm2_tokenizer):
    tokenizer = harmony_tokenizer(smollm2_tokenizer)
    segments = harmony_segments([{"role": "user", "content": "x<|end|>"}], current_date=DATE)
    ids = encode_harmony(tokenizer, segments)
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert ids.count(end) == 2  # the system message's and the user message's, not the text's
    assert tokenizer.decode(ids) == render_harmony([{"role": "user", "content": "x<|end|>"}],
                                                   current_date=DATE)
    assert stop_token_ids(tokenizer) == tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    with pytest.raises(ValueError, match="no single token for the harmony control token"):
        encode_harmony(smollm2_tokenizer, segments)


def harmony_tokenizer(tokenizer):
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": list(CONTROL_TOKENS)})
    return tokenizer
