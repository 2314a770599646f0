"""`--structured-outputs-config` backends through the offline engine (`LLM`): guidance
forced runs every constraint kind; `auto` (the default) serves with guidance a schema
only guidance enforces; xgrammar forced, and any backend for a keyword none enforces,
refuse naming the keyword; the engine goes on after each refusal."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagoda import LLM
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from structured_output_cases import (CASES, MAX_TOKENS, MULTIPLE_OF, NOT_FIVE, REGEX,
                                     check_output)

PROMPTS = ["The weather today is", "List three colours:", "My favourite number"]


def params(schema, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **kw,
                          structured_outputs=StructuredOutputsParams(
                              json=schema, disable_any_whitespace=True))


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    made = {}

    def get(backend: str | None) -> LLM:
        if backend not in made:
            config = {"structured_outputs_config": {"backend": backend}} if backend else {}
            made[backend] = LLM(tiny_llama_dir, max_model_len=512, **config)
        return made[backend]

    return get


@pytest.mark.parametrize("kind", list(CASES))
def test_guidance_forced_holds_every_constraint_kind(engines, kind):
    """The regex spells its digits [0-9]: llguidance's `\\d` is Rust's, any Unicode
    digit (the random model writes Tibetan ones), where xgrammar's is ASCII."""
    llm = engines("guidance")
    constraint = dict(CASES[kind], **({"regex": REGEX.replace(r"\d", "[0-9]")}
                                      if kind == "regex" else {}))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                              structured_outputs=StructuredOutputsParams(**constraint))
    for out in llm.generate(PROMPTS, sampling, use_tqdm=False):
        check_output(kind, out.outputs[0].text, out.outputs[0].finish_reason,
                     llm.get_tokenizer())


@pytest.mark.parametrize("backend", [None, "auto", "guidance"])
def test_a_schema_only_guidance_enforces_is_served(engines, backend):
    outputs = engines(backend).generate(PROMPTS, params(MULTIPLE_OF), use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        value = json.loads(out.outputs[0].text)
        jsonschema.validate(value, MULTIPLE_OF)
        assert value["n"] % 3 == 0


@pytest.mark.parametrize("backend, schema, named", [
    ("xgrammar", MULTIPLE_OF, "`allOf` with 2 members"),
    ("xgrammar", {"multipleOf": 3}, "`multipleOf`"),
    ("xgrammar", NOT_FIVE, "`not`"),
    (None, NOT_FIVE, "`not`"),
    ("guidance", NOT_FIVE, '"not"'),
])
def test_what_the_backend_cannot_enforce_is_a_value_error_naming_it(engines, backend, schema,
                                                                   named):
    llm = engines(backend)
    with pytest.raises(ValueError, match="structured_outputs.json") as info:
        llm.generate(PROMPTS[0], params(schema), use_tqdm=False)
    assert named in str(info.value)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate(PROMPTS[0], params({"type": "integer", "minimum": 0, "maximum": 9}),
                       use_tqdm=False)[0].outputs[0]
    assert 0 <= int(out.text) <= 9


def test_a_grammar_that_fails_to_compile_ends_only_its_request(engines):
    """`<|nope|>` passes the check at intake and fails against the vocabulary: that
    request ends (aborted, no text), its neighbour in the same batch is served."""
    llm = engines("guidance")
    broken = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        grammar="start: <|nope|>"))
    outs = llm.generate(PROMPTS[:2], [broken, params({"type": "integer", "minimum": 0,
                                                      "maximum": 9})], use_tqdm=False)
    assert (outs[0].outputs[0].text, outs[0].outputs[0].finish_reason) == ("", "abort")
    assert 0 <= int(outs[1].outputs[0].text) <= 9
