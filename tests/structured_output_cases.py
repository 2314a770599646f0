"""Constraints every structured-output test runs, and how to check an output against one.

Each case but `json_object` is bounded so that even a random model finishes well inside
`MAX_TOKENS` (strings have a maxLength, numbers a range, JSON has no free whitespace); an
object of any keys may run to the length limit, and then it must be a valid prefix.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from fixture_paths import TINY_LLAMA_CONFIG

THINK_VOCAB_SIZE = 49160  # the tokenizer has 49154 tokens: 6 padding rows past it
MAX_TOKENS = 64
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
# xgrammar drops `multipleOf` outside a numeric `type` and `allOf` with two members (so
# it refuses them); llguidance enforces both: `auto` serves this with guidance. Bounded
# so a random model finishes.
MULTIPLE_OF = {"type": "object", "properties": {"n": {"allOf": [
    {"type": "integer", "minimum": 0, "maximum": 99}, {"multipleOf": 3}]}},
    "required": ["n"], "additionalProperties": False}
# No backend enforces `not`: a 400 naming it, whichever backend.
NOT_FIVE = {"type": "integer", "not": {"const": 5}}
REGEX = r"[a-z]{2,4}-\d{2}"
CHOICES = ["yes", "no", "maybe"]
GRAMMAR = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "d" [0-9]'

# kind -> StructuredOutputsParams keyword arguments.
CASES = {
    "json": dict(json=PERSON_SCHEMA, disable_any_whitespace=True),
    "regex": dict(regex=REGEX),
    "choice": dict(choice=CHOICES),
    "grammar": dict(grammar=GRAMMAR),
    "json_object": dict(json_object=True, disable_any_whitespace=True),
}


def grammar_accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether xgrammar's matcher takes `text` as a complete derivation of `grammar`."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.is_completed()


def is_json_object_prefix(tokenizer, text: str) -> bool:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_json_schema('{"type": "object"}',
                                                             any_whitespace=False,
                                                             strict_mode=False)
    return xgr.GrammarMatcher(compiled).accept_string(text)


def check_output(kind: str, text: str, finish_reason: str = "stop", tokenizer=None) -> None:
    """Assert `text` satisfies the constraint of CASES[kind] (a json_object cut by the
    length limit: is a valid prefix of one)."""
    if kind == "json_object" and finish_reason == "length":
        assert text.startswith("{") and is_json_object_prefix(tokenizer, text), text
        return
    assert finish_reason == "stop", (kind, text, finish_reason)
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    elif kind == "grammar":
        assert re.fullmatch(r"\(([a-c]|d[0-9])(,([a-c]|d[0-9]))*\)", text), text
        if tokenizer is not None:
            assert grammar_accepts(tokenizer, GRAMMAR, text), text
    else:
        raise AssertionError(kind)


# ---------------------------------------------------------------- fixtures
# A tiny random model whose tokenizer has `<think>`/`</think>` tokens (a reasoning model's
# vocabulary) and whose embedding is larger than the tokenizer (as real models pad it).
# Test modules import these to use them.
@pytest.fixture(scope="session")
def think_model_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """The tiny Llama with SmolLM2's tokenizer plus `<think>` and `</think>` (added, not
    special: they show in the text, as in Qwen3's and DeepSeek-R1's tokenizers)."""
    import torch
    from transformers import AddedToken, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_json_file(str(TINY_LLAMA_CONFIG))
    config.vocab_size = THINK_VOCAB_SIZE
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("think_llama")
    model.save_pretrained(out)
    tokenizer = type(smollm2_tokenizer).from_pretrained(_saved(smollm2_tokenizer,
                                                               tmp_path_factory))
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False),
                          AddedToken("</think>", special=False, normalized=False)])
    tokenizer.save_pretrained(out)
    assert len(tokenizer) < THINK_VOCAB_SIZE
    return str(out)


def _saved(tokenizer, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("smollm2_tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def think_tokenizer(think_model_dir):
    from pagoda.tokenizer.loader import load_tokenizer

    return load_tokenizer(think_model_dir)
