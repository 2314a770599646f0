"""Constraints every structured-output test runs, and how to check an output against one.

Each case but `json_object` is bounded so that even a random model finishes well inside
`MAX_TOKENS` (strings have a maxLength, numbers a range, JSON has no free whitespace); an
object of any keys may run to the length limit, and then it must be a valid prefix.
"""

from __future__ import annotations

import json
import re

import jsonschema

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
