"""The JSON-schema keywords the xgrammar backend compiles but does not enforce.

xgrammar accepts any schema and drops what it cannot express: `{"not": {"const": 5}}`
compiles and the model may then answer 5. A constraint that is silently not applied is
a wrong answer, so the backend refuses such a schema at intake (a 400 naming the
keyword and where it stands) instead; `auto` then hands it to guidance, which enforces
some of these keywords and refuses the rest itself (`guidance_backend.py`).

Measured against xgrammar's own matcher (tests/structured_output/test_json_schema_support.py
checks each keyword both ways, so this list cannot go stale unnoticed when xgrammar
changes): `not`, `if`/`then`/`else`, `dependentRequired`/`dependentSchemas`,
`uniqueItems`, `contains`, `allOf` with more than one member, a `$ref` outside the
document, an unknown `format`, and a numeric or string keyword on a schema whose `type`
does not say number or string (xgrammar applies `multipleOf`, `minimum`, `minLength`,
`pattern`... only beside their type).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Keywords xgrammar ignores wherever they stand.
UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
              "dependencies", "contains", "minContains", "maxContains")
NUMERIC_KEYWORDS = ("multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
# JSON Schema's formats that xgrammar builds a grammar for.
FORMATS = frozenset(("email", "date", "time", "date-time", "duration", "uuid", "uri",
                     "uri-reference", "uri-template", "ipv4", "ipv6", "hostname", "idn-email",
                     "idn-hostname", "iri", "iri-reference", "json-pointer",
                     "relative-json-pointer"))
# Where a schema holds subschemas: keyword -> how (one schema, a list, a name map).
_ONE = ("additionalProperties", "items", "unevaluatedProperties", "propertyNames")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_keywords(schema: Any) -> list[str]:
    """Each keyword in `schema` that xgrammar would not enforce, as "keyword at path"
    (JSON-pointer style, "#" for the root); empty when it enforces the whole schema."""
    return list(_walk(schema, "#"))


def _walk(node: Any, path: str) -> Iterator[str]:
    if not isinstance(node, dict):
        return
    for keyword in UNENFORCED:
        if keyword in node:
            yield f"`{keyword}` at {path}"
    if node.get("uniqueItems"):
        yield f"`uniqueItems` at {path}"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield f"`$ref` to another document ({ref!r}) at {path}"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        yield f"`allOf` with {len(node['allOf'])} members at {path}"
    yield from _typed_keywords(node, path)
    for keyword in _ONE:
        yield from _walk(node.get(keyword), f"{path}/{keyword}")
    for keyword in _LIST:
        members = node.get(keyword)
        for i, member in enumerate(members if isinstance(members, list) else ()):
            yield from _walk(member, f"{path}/{keyword}/{i}")
    for keyword in _MAP:
        members = node.get(keyword)
        for name, member in (members.items() if isinstance(members, dict) else ()):
            yield from _walk(member, f"{path}/{keyword}/{name}")


def _typed_keywords(node: dict, path: str) -> Iterator[str]:
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types or ())
    if not types & {"integer", "number"}:
        for keyword in NUMERIC_KEYWORDS:
            if keyword in node:
                yield f"`{keyword}` without a numeric `type` at {path}"
    if "string" not in types:
        for keyword in STRING_KEYWORDS:
            if keyword in node:
                yield f"`{keyword}` without `\"type\": \"string\"` at {path}"
    elif "format" in node and node["format"] not in FORMATS:
        yield f"`format` {node['format']!r} at {path}"
