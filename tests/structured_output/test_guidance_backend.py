"""The guidance backend and `auto`, measured against llguidance's own matcher: the schema
keywords xgrammar refuses that llguidance enforces are served (auto picks guidance), the
ones neither enforces stay a refusal naming the keyword, and the masks really forbid
what the schema forbids."""

from __future__ import annotations

import llguidance as llg
import llguidance.hf
import numpy as np
import pytest

from pagoda.config import StructuredOutputsConfig
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.auto_backend import AutoBackend
from pagoda.structured_output.guidance_backend import GuidanceBackend
from pagoda.structured_output.xgrammar_backend import XgrammarBackend

EOS = 2
GUIDANCE = StructuredOutputsConfig(backend="guidance")


@pytest.fixture(scope="module")
def ll_tokenizer(smollm2_tokenizer):
    return llguidance.hf.from_tokenizer(smollm2_tokenizer, n_vocab=49152, eos_token=[EOS])


def ll_accepts(ll_tokenizer, schema: dict, text: str) -> bool:
    """Whether llguidance's matcher takes `text` as a whole answer of `schema`."""
    matcher = llg.LLMatcher(ll_tokenizer, llg.LLMatcher.grammar_from_json_schema(schema),
                            log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(ll_tokenizer.tokenize_str(text)) and matcher.is_accepting()


# (schema, a string it forbids, one it allows): xgrammar refuses, llguidance enforces.
FALLS_BACK = [
    ({"multipleOf": 3}, "4", "6"),
    ({"minimum": 3}, "2", "3"),
    ({"minLength": 3}, '"ab"', '"abc"'),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "1", "2"),
    ({"type": "object", "properties": {"n": {"multipleOf": 3}}, "required": ["n"]},
     '{"n": 4}', '{"n": 9}'),
]
# (schema, the keyword the refusal names): neither backend enforces it.
REFUSED = [
    ({"not": {"const": 5}}, "not"),
    ({"type": "integer", "not": {"const": 5}}, "not"),
    ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2},
      "else": {"maximum": 3}}, "if"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "contains"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "bogus"}, "bogus"),
    ({"$ref": "http://example.com/x.json"}, "http://example.com/x.json"),
    ({"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}}, "not"),
]


@pytest.mark.parametrize("schema, forbidden, allowed", FALLS_BACK)
def test_auto_serves_with_guidance_what_only_guidance_enforces(ll_tokenizer, schema, forbidden,
                                                                allowed):
    assert not ll_accepts(ll_tokenizer, schema, forbidden)
    assert ll_accepts(ll_tokenizer, schema, allowed)
    params = StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError, match="cannot enforce"):
        XgrammarBackend.parse(params)
    assert AutoBackend.parse(params)[0] == "guidance"


@pytest.mark.parametrize("schema, keyword", REFUSED)
def test_what_no_backend_enforces_is_refused_naming_the_keyword(schema, keyword):
    params = StructuredOutputsParams(json=schema)
    with pytest.raises(ValueError) as guidance:
        GuidanceBackend.parse(params)
    assert keyword in str(guidance.value), "llguidance takes this now: check it enforces it"
    with pytest.raises(ValueError) as auto:
        AutoBackend.parse(params)
    assert keyword in str(auto.value) and "guidance backend cannot take it" in str(auto.value)


def test_auto_keeps_xgrammar_for_what_it_enforces():
    for kwargs in (dict(json={"type": "integer", "multipleOf": 3}), dict(regex="[a-z]+"),
                   dict(choice=["a", "b"]), dict(grammar='root ::= "x"'), dict(json_object=True)):
        assert AutoBackend.parse(StructuredOutputsParams(**kwargs))[0] == "xgrammar"
    # A Lark grammar is no EBNF for xgrammar: guidance takes it.
    assert AutoBackend.parse(StructuredOutputsParams(grammar='start: "x"'))[0] == "guidance"


def allowed_ids(manager, so_request) -> set[int]:
    row = manager.grammar_bitmask([so_request])[0]
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def ready(manager, constraint: dict, eos=(EOS,)):
    so_request = manager.init_request(StructuredOutputsParams(**constraint), [])
    so_request.future.result(timeout=60)
    assert manager.check_ready(so_request, list(eos), []) is None
    return so_request


@pytest.mark.parametrize("backend", ["guidance", "auto"])
def test_the_mask_forbids_ending_on_a_number_that_is_no_multiple(make_manager, smollm2_tokenizer,
                                                                 backend):
    manager = make_manager(StructuredOutputsConfig(backend=backend))
    four, six, two, a = (smollm2_tokenizer.convert_tokens_to_ids(t) for t in "462a")
    so_request = ready(manager, dict(json={"multipleOf": 3}, disable_any_whitespace=True))
    assert so_request.grammar.backend == "guidance"
    grammar = so_request.grammar
    assert grammar.accept_token(four)
    assert EOS not in allowed_ids(manager, so_request)  # "4" is no answer
    assert a not in allowed_ids(manager, so_request)
    assert not grammar.accept_token(EOS) and not grammar.is_terminated()
    assert not grammar.accept_token(a)  # refused, state unchanged: "42" still follows
    assert grammar.accept_token(two) and EOS in allowed_ids(manager, so_request)
    assert grammar.accept_token(EOS) and grammar.is_terminated()
    grammar.reset()
    assert grammar.accept_token(six) and EOS in allowed_ids(manager, so_request)


def test_every_constraint_kind_compiles_and_masks(make_manager, smollm2_tokenizer):
    manager = make_manager(GUIDANCE)
    cases = [(dict(regex=r"[a-c]{2}"), "ab"), (dict(choice=["yes", "no"]), "no"),
             (dict(grammar='root ::= "(" [a-c] ")"'), "(b)"),  # GBNF, converted
             (dict(grammar='start: "(" /[a-c]/ ")"'), "(c)"),  # Lark
             (dict(json_object=True, disable_any_whitespace=True), '{"a":1}'),
             (dict(structural_tag={"structures": [{"begin": "<f>", "schema": {"type": "integer"},
                                                   "end": "</f>"}], "triggers": ["<f"]}),
              "x <f>12</f>")]
    for constraint, text in cases:
        so_request = ready(manager, constraint)
        for token in smollm2_tokenizer.encode(text, add_special_tokens=False):
            assert token in allowed_ids(manager, so_request), (constraint, text)
            assert so_request.grammar.accept_token(token), (constraint, text)
        assert so_request.grammar.accept_token(EOS), (constraint, text)


def test_the_newer_structural_tag_form_is_refused_naming_it():
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": "x"}}
    with pytest.raises(ValueError, match="structured_outputs.structural_tag.*structures"):
        GuidanceBackend.parse(StructuredOutputsParams(structural_tag=tag))
    assert AutoBackend.parse(StructuredOutputsParams(structural_tag=tag))[0] == "xgrammar"


def test_a_grammar_the_vocabulary_breaks_fails_its_request_not_the_manager(make_manager):
    """`<|nope|>` passes the vocabulary-free check at intake; compiling it against the
    tokenizer fails, and that is the request's error (the manager goes on)."""
    manager = make_manager(GUIDANCE)
    so_request = manager.init_request(StructuredOutputsParams(grammar="start: <|nope|>"), [])
    with pytest.raises(ValueError, match="unknown special token"):
        so_request.future.result(timeout=60)
    assert "unknown special token" in manager.check_ready(so_request, [EOS], [])
    assert ready(manager, dict(regex="a")).grammar is not None


def test_the_requests_stop_tokens_end_the_text(make_manager):
    """A request's EOS ids other than the model's: those, not the model's, may end it."""
    manager = make_manager(GUIDANCE)
    so_request = ready(manager, dict(choice=["a"]), eos=(7, 9))
    assert not {7, 9} & allowed_ids(manager, so_request)
    assert so_request.grammar.accept_token(manager.backend.ll_tokenizer.tokenize_str("a")[0])
    assert allowed_ids(manager, so_request) == {7, 9}
    assert not so_request.grammar.accept_token(EOS) and so_request.grammar.accept_token(9)


def test_a_mixed_batch_gets_each_row_from_its_own_backend(make_manager):
    auto, guidance = make_manager(), make_manager(GUIDANCE)
    xgr_row = ready(auto, dict(regex="[0-9]"))
    ll_row = ready(auto, dict(json={"minimum": 3}, disable_any_whitespace=True))
    assert (xgr_row.grammar.backend, ll_row.grammar.backend) == ("xgrammar", "guidance")
    both = auto.grammar_bitmask([xgr_row, ll_row, xgr_row])
    alone = guidance.grammar_bitmask([ready(guidance, dict(json={"minimum": 3},
                                                           disable_any_whitespace=True))])
    assert (both[1] == alone[0]).all() and (both[0] == both[2]).all()
    assert (both[0] == auto.grammar_bitmask([xgr_row])[0]).all()
    assert (both[0] != both[1]).any()
