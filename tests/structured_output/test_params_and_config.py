"""`StructuredOutputsParams` (vLLM's names, one constraint, errors naming the field) and
`--structured-outputs-config` / `--reasoning-parser` as the engine reads them."""

from __future__ import annotations

import pydantic
import pytest

from pagoda.config import StructuredOutputsConfig
from pagoda.engine.arg_utils import EngineArgs
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams


class Person(pydantic.BaseModel):
    name: str
    age: int


def test_one_constraint_in_its_canonical_form():
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    assert StructuredOutputsParams(json=Person).json == Person.model_json_schema()
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["a", "b"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "one of json, regex, choice, grammar, json_object, structural_tag is required"),
    (dict(regex="a", choice=["a"]), "only one kind of constraint may be given, got regex and choice"),
    (dict(json="{nope"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1]), "structured_outputs.json must be a JSON schema"),
    (dict(choice=[]), "structured_outputs.choice must be a non-empty list"),
    (dict(choice=["a", 1]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex must be a non-empty string"),
    (dict(structural_tag="[1]"), "structured_outputs.structural_tag must be a JSON object"),
])
def test_invalid_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_reject_a_foreign_type():
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")


@pytest.mark.parametrize("value, reasoning, message", [
    ('{"backend": "outlines"}', None,
     "backend 'outlines' is not supported; Pagoda has auto, xgrammar, guidance"),
    ('{"backend": "xgrammar", "typo": 1}', None, "unknown key"),
    ("{nope", None, "not valid JSON"),
    (None, "nope", "Unknown reasoning parser 'nope'"),
])
def test_bad_config_is_refused_clearly(value, reasoning, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsConfig.parse(value, reasoning)


def test_config_from_the_command_line():
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--structured-outputs-config", '{"backend": "auto"}',
                              "--reasoning-parser", "qwen3"])
    engine_args = EngineArgs.from_cli_args(args)
    config = StructuredOutputsConfig.parse(engine_args.structured_outputs_config,
                                           engine_args.reasoning_parser)
    assert (config.backend, config.reasoning_parser) == ("auto", "qwen3")
    for backend in ("xgrammar", "guidance"):
        assert StructuredOutputsConfig.parse({"backend": backend}).backend == backend
