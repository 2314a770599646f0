"""The request fields that constrain an answer -> one StructuredOutputsParams, or a 400."""

from __future__ import annotations

import pytest

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.openai.request_models import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> StructuredOutputsParams | None:
    return ChatCompletionRequest(messages=MESSAGES, **fields).structured_output_params()


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "strict": True, "schema": SCHEMA}}}, StructuredOutputsParams(json=SCHEMA)),
    ({"structured_outputs": {"regex": r"\d+"}}, StructuredOutputsParams(regex=r"\d+")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True,
                             "disable_fallback": False}},
     StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
    ({"response_format": {"type": "structural_tag", "structures": [], "triggers": []}},
     StructuredOutputsParams(structural_tag={"type": "structural_tag", "structures": [],
                                             "triggers": []})),
])
def test_each_field_maps_to_its_constraint(fields, expected):
    assert chat(**fields) == expected
    params = ChatCompletionRequest(messages=MESSAGES, **fields).to_sampling_params(8, 100)
    assert params.structured_outputs == expected


def test_completions_take_the_same_fields():
    body = CompletionRequest(prompt="x", guided_choice=["up", "down"])
    assert body.to_sampling_params(4, 100).structured_outputs.choice == ["up", "down"]


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", "got 'xml'"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "got response_format and guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "only one kind of constraint"),
    ({"structured_outputs": {"whitespace_pattern": "[ ]"}}, "structured_outputs",
     "whitespace_pattern is not supported"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
])
def test_bad_constraints_are_400s_naming_the_field(fields, param, message):
    with pytest.raises(APIError) as info:
        ChatCompletionRequest(messages=MESSAGES, **fields).check_common()
    assert info.value.status == 400 and info.value.param == param
    assert message in info.value.message
