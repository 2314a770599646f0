"""Schema keywords the xgrammar backend would compile and ignore are refused at intake,
and the list is checked against xgrammar's own matcher both ways: what is refused is
really not enforced, what is kept really is."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.json_schema_support import unenforced_keywords
from pagoda.structured_output.xgrammar_backend import XgrammarBackend


def accepts(schema: dict, text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


# (schema, a string the schema forbids, the keyword the refusal names)
REFUSED = [
    ({"type": "integer", "not": {"const": 5}}, "5", "`not` at #"),
    ({"not": {"const": 5}}, "5", "`not` at #"),
    ({"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2},
      "else": {"maximum": 3}}, "5", "`if` at #"),
    ({"multipleOf": 3}, "4", "`multipleOf` without a numeric `type` at #"),
    ({"minimum": 3}, "2", "`minimum` without a numeric `type` at #"),
    ({"minLength": 3}, '"ab"', "`minLength` without `\"type\": \"string\"` at #"),
    ({"type": "string", "format": "bogus"}, '"x"', "`format` 'bogus' at #"),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "1", "`allOf` with 2 members at #"),
    ({"$ref": "http://example.com/x.json"}, "1", "`$ref` to another document"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]",
     "`uniqueItems` at #"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "[2]",
     "`contains` at #"),
    ({"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}},
      "required": ["a"]}, '{"a": 1}', "`not` at #/properties/a"),
]
# (schema, a string it forbids, one it allows): enforced, so served.
KEPT = [
    ({"type": "integer", "multipleOf": 3}, "4", "6"),
    ({"type": ["integer", "null"], "minimum": 3}, "2", "null"),
    ({"type": "string", "minLength": 3}, '"ab"', '"abc"'),
    ({"type": "string", "pattern": "^a+$"}, '"b"', '"aa"'),
    ({"type": "string", "format": "email"}, '"nope"', '"a@b.co"'),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true", "1"),
    ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, '"s"', "1"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "additionalProperties": False}, '{"a": 1, "c": 2}', '{"a": 1}'),
]


@pytest.mark.parametrize("schema, forbidden, named", REFUSED)
def test_a_keyword_xgrammar_ignores_is_refused_naming_it(schema, forbidden, named):
    assert accepts(schema, forbidden), "xgrammar now enforces this: keep it, drop the refusal"
    assert any(named in item for item in unenforced_keywords(schema)), unenforced_keywords(schema)
    with pytest.raises(ValueError, match="cannot enforce"):
        XgrammarBackend.parse(StructuredOutputsParams(json=schema))


@pytest.mark.parametrize("schema, forbidden, allowed", KEPT)
def test_what_xgrammar_enforces_is_served(schema, forbidden, allowed):
    assert not accepts(schema, forbidden) and accepts(schema, allowed)
    assert unenforced_keywords(schema) == []
    XgrammarBackend.parse(StructuredOutputsParams(json=schema))
