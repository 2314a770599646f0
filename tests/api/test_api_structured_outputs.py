"""Structured outputs, forced tool calls and reasoning against real clusters, with the
official openai client: the tiny random Llama (every request field, streamed and not,
400s for bad constraints with the server still healthy), a reasoning vocabulary (the
grammar starts after `</think>`), and the default SmolLM2 model (`parse()` round trip).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest
from serve_cluster import ServeProcess
from structured_output_cases import (CHOICES, GRAMMAR, MULTIPLE_OF, NOT_FIVE, PERSON_SCHEMA,
                                     REGEX, check_output, think_model_dir,
                                     think_tokenizer)  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "user", "content": "Tell me about someone."}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]
COMPACT_PERSON = {"json": PERSON_SCHEMA, "disable_any_whitespace": True}


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    """The default backend, `auto`: xgrammar for what it enforces, else guidance."""
    serve = ServeProcess([tiny_llama_dir, "--served-model-name", "tiny", "--max-model-len", "512"])
    yield serve
    assert serve.stop() == 0, serve.stderr_text()[-3000:]


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster.url, api_key="unused", max_retries=0, timeout=120)


def chat(client, **kw):
    kw.setdefault("max_tokens", 64)
    return client.chat.completions.create(model="tiny", messages=MESSAGES, **kw)


def streamed_text(stream) -> tuple[str, str | None, int]:
    text, finish, usage = "", None, 0
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


@pytest.mark.parametrize("extra, kind", [
    ({"structured_outputs": COMPACT_PERSON}, "json"),
    ({"structured_outputs": {"regex": REGEX}}, "regex"),
    ({"structured_outputs": {"choice": CHOICES}}, "choice"),
    ({"structured_outputs": {"grammar": GRAMMAR}}, "grammar"),
    ({"guided_regex": REGEX}, "regex"),
    ({"guided_choice": CHOICES}, "choice"),
    ({"guided_grammar": GRAMMAR}, "grammar"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
     "json_object"),
])
def test_request_fields_constrain_the_answer_streamed_and_not(client, smollm2_tokenizer, extra,
                                                             kind):
    reply = chat(client, temperature=0.0, extra_body=extra)
    text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    check_output(kind, text, finish, smollm2_tokenizer)
    streamed, streamed_finish, usage = streamed_text(chat(
        client, temperature=0.0, extra_body=extra, stream=True,
        stream_options={"include_usage": True}))
    assert (streamed, streamed_finish, usage) == (text, finish, reply.usage.completion_tokens)
    sampled = chat(client, temperature=1.0, seed=7, n=3, extra_body=extra)
    for choice in sampled.choices:
        check_output(kind, choice.message.content, choice.finish_reason, smollm2_tokenizer)


# vLLM's structural_tag (xgrammar's tag format): a fixed opening tag, a JSON value from a
# schema, a fixed closing tag; nothing else may be written.
STRUCTURAL_TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<color>"},
    {"type": "json_schema", "json_schema": {"enum": ["red", "green", "blue"]}},
    {"type": "const_string", "value": "</color>"}]}}


@pytest.mark.parametrize("extra", [
    {"response_format": STRUCTURAL_TAG},
    {"structured_outputs": {"structural_tag": json.dumps(STRUCTURAL_TAG)}},  # vLLM's: a string
], ids=["response_format", "structured_outputs"])
def test_structural_tag_constrains_the_answer_streamed_and_not(client, extra):
    reply = chat(client, temperature=0.0, extra_body=extra)
    text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop" and re.fullmatch(r'<color>"(red|green|blue)"</color>', text), text
    streamed, streamed_finish, _ = streamed_text(chat(
        client, temperature=0.0, extra_body=extra, stream=True,
        stream_options={"include_usage": True}))
    assert (streamed, streamed_finish) == (text, finish)
    for choice in chat(client, temperature=1.0, seed=3, n=2, extra_body=extra).choices:
        assert re.fullmatch(r'<color>"(red|green|blue)"</color>', choice.message.content)


def test_response_format_kinds(client):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                            "schema": PERSON_SCHEMA}}
    for response_format in (schema_format, {"type": "json_object"}):
        reply = chat(client, temperature=0.0, response_format=response_format)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert text.lstrip().startswith("{")
        if finish == "stop":  # a random model may spend the budget on JSON whitespace
            value = json.loads(text)
            if response_format is schema_format:
                jsonschema.validate(value, PERSON_SCHEMA)
    assert chat(client, response_format={"type": "text"}, max_tokens=4).choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_auto_serves_a_schema_only_guidance_enforces(client, stream):
    """xgrammar refuses MULTIPLE_OF (it would drop `multipleOf`); auto hands it to guidance."""
    extra = {"structured_outputs": {"json": MULTIPLE_OF, "disable_any_whitespace": True}}
    if stream:
        text, finish, _ = streamed_text(chat(client, temperature=0.0, extra_body=extra,
                                             stream=True))
    else:
        reply = chat(client, temperature=0.0, extra_body=extra)
        text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
    assert finish == "stop", text
    value = json.loads(text)
    jsonschema.validate(value, MULTIPLE_OF)
    assert value["n"] % 3 == 0


def test_completions_take_structured_outputs(client):
    reply = client.completions.create(model="tiny", prompt="Pick:", max_tokens=16,
                                      temperature=0.0, extra_body={"guided_choice": CHOICES})
    assert reply.choices[0].text in CHOICES


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_always_gives_valid_calls(client, stream):
    """Without parallel_tool_calls exactly one call; with them a list (a random model may
    run the list to the length limit, and then no call is returned half-made)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    kwargs = dict(tools=TOOLS, tool_choice="required", max_tokens=300)
    for seed in range(3):
        calls, finish = _calls(chat(client, stream=stream, parallel_tool_calls=False,
                                    temperature=1.0, seed=seed, **kwargs), stream)
        assert finish == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0][1]), schemas[calls[0][0]])
    finished = 0
    for seed in range(4):
        calls, finish = _calls(chat(client, stream=stream, temperature=1.0, seed=seed,
                                    **kwargs), stream, allow_length=True)
        if finish == "tool_calls":
            finished += 1
            for name, arguments in calls:
                jsonschema.validate(json.loads(arguments), schemas[name])
    assert finished


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_is_called_with_valid_arguments(client, stream):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    calls, finish = _calls(chat(client, tools=TOOLS, tool_choice=choice, temperature=0.0,
                                max_tokens=120, stream=stream), stream)
    assert finish == "tool_calls" and [name for name, _ in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0][1]), TOOLS[0]["function"]["parameters"])


def _calls(reply, stream: bool, allow_length: bool = False
           ) -> tuple[list[tuple[str, str]], str | None]:
    if not stream:
        message = reply.choices[0].message
        if allow_length and reply.choices[0].finish_reason == "length":
            return [], "length"
        assert message.content is None
        ids = [c.id for c in message.tool_calls]
        assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == len(ids)
        return [(c.function.name, c.function.arguments) for c in message.tool_calls], \
            reply.choices[0].finish_reason
    calls, finish = {}, None
    for chunk in reply:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    calls[call.index] = [call.function.name, ""]
                else:
                    assert call.function.name is None
                calls[call.index][1] += call.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("kwargs, message", [
    (dict(extra_body={"guided_regex": "a(b"}), "Regex parsing error"),
    (dict(extra_body={"structured_outputs": {"json": {"type": "nonsense"}}}),
     'Unsupported type "nonsense"'),
    (dict(extra_body={"guided_grammar": "root ::= missing_rule"}), "missing_rule"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "needs json_schema.schema"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "not in tools"),
    (dict(tool_choice={"type": "function", "function": {"name": "now"}}), "no tools"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools[0]"),
    (dict(extra_body={"guided_regex": "a", "guided_choice": ["a"]}), "Only one kind"),
    (dict(extra_body={"guided_json": NOT_FIVE}), "cannot enforce `not`"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400s_and_the_server_stays_healthy(cluster, client, kwargs,
                                                               message, stream):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, stream=stream, **kwargs)
    assert message in info.value.body["message"]
    assert httpx.get(cluster.url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
    check_output("regex", chat(client, temperature=0.0, max_tokens=16,
                               extra_body={"guided_regex": REGEX}).choices[0].message.content)


# ---------------------------------------------------------------- reasoning
@pytest.fixture(scope="module")
def reasoning_cluster(think_model_dir):
    serve = ServeProcess([think_model_dir, "--served-model-name", "thinker", "--max-model-len",
                          "256", "--reasoning-parser", "deepseek_r1"])
    yield serve
    assert serve.stop() == 0, serve.stderr_text()[-3000:]


@pytest.mark.extended  # make test-extended: its own reasoning cluster; tests/structured_output covers it offline
@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_then_a_constrained_answer(reasoning_cluster, think_tokenizer, stream):
    """`</think>` pushed up by a logit bias ends the reasoning at once (the grammar waits
    for it), then the answer obeys the regex, in `content`; nothing is left in
    `reasoning_content`. Without the bias the reasoning runs free (all reasoning_content)."""
    client = openai.OpenAI(base_url=reasoning_cluster.url, api_key="x", max_retries=0,
                           timeout=120)
    end = think_tokenizer.get_vocab()["</think>"]
    kwargs = dict(model="thinker", messages=MESSAGES, max_tokens=32, temperature=0.0,
                  logit_bias={str(end): 100}, extra_body={"guided_regex": REGEX})
    reasoning, content = _reasoning_and_content(client, stream, **kwargs)
    assert not reasoning and re.fullmatch(REGEX, content)
    del kwargs["logit_bias"]
    reasoning, content = _reasoning_and_content(client, stream, **{**kwargs, "max_tokens": 8})
    assert reasoning and not content


def _reasoning_and_content(client, stream: bool, **kwargs) -> tuple[str | None, str | None]:
    reply = client.chat.completions.create(stream=stream, **kwargs)
    if not stream:
        message = reply.choices[0].message
        return message.reasoning_content, message.content
    reasoning, content = "", ""
    for chunk in reply:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    return reasoning or None, content or None


# ---------------------------------------------------------------- the default model
class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.mark.extended  # make test-extended: a SmolLM2 cluster of its own
def test_openai_parse_round_trips_a_pydantic_model():
    serve = ServeProcess(["--served-model-name", "smol", "--max-model-len", "1024"])
    try:
        client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=300)
        reply = client.chat.completions.parse(
            model="smol", temperature=0.0, max_tokens=60, response_format=Person,
            messages=[{"role": "user", "content": "Ana is 31 years old. Give her name and "
                                                  "age as JSON."}])
        person = reply.choices[0].message.parsed
        assert isinstance(person, Person) and person.name and person.age >= 0
    finally:
        assert serve.stop() == 0
