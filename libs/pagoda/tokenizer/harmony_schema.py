"""JSON-schema function parameters -> the TypeScript-like types of harmony's `# Tools`.

gpt-oss was trained on tools declared as `type NAME = (_: {...}) => any;` inside a
`namespace functions { ... }` (OpenAI's harmony guide, "Function calling"). This is
the renderer's reading of a JSON schema, written from the guide and the rules of the
reference renderer, so the model sees the text it was trained on:

- an object is `{`, one line per property, `}` (`name?:` when not required; a
  property's title, description and string examples are `//` comment lines above it;
  its default a trailing `// default: ...` comment; nested objects indent 4 more);
- string enums are `"a" | "b"`, integer and number are `number`, an array is
  `ITEM[]` (`Array<any>` without items), a list of types is joined with ` | `,
  `nullable` adds ` | null`, anything else is `any`;
- `oneOf` (at the top or on a property) lists its variants one per line as ` | T`.

Invariant: the output is a pure function of the schema (property order is the
schema's own, as the request gave it), so the same tools always give the same tokens.
"""

from __future__ import annotations

import json
from typing import Any


def schema_to_typescript(schema: Any, indent: str = "") -> str:
    """The type text of `schema` at `indent` (the indent of the lines it opens)."""
    if not isinstance(schema, dict):
        return "any"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list):
        return "".join(f"\n{indent} | " + _variant(v, indent) for v in one_of)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        values = schema.get("enum")
        values = values if isinstance(values, list) else []
        quoted = [f'"{v}"' for v in values if isinstance(v, str)]
        return " | ".join(quoted) if quoted else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        items = schema.get("items")
        return f"{schema_to_typescript(items, indent)}[]" if items is not None else "Array<any>"
    return "any"


def _object(schema: dict, indent: str) -> str:
    out = []
    description = schema.get("description")
    if isinstance(description, str):
        out.append(f"{indent}// {description}\n")
    out.append("{\n")
    properties = schema.get("properties")
    if isinstance(properties, dict):
        required = schema.get("required")
        required = required if isinstance(required, list) else []
        required = {r for r in required if isinstance(r, str)}
        for key, prop in properties.items():
            out.append(_property(key, prop if isinstance(prop, dict) else {}, key in required,
                                 indent))
    out.append(f"{indent}}}")
    return "".join(out)


def _property(key: str, prop: dict, required: bool, indent: str) -> str:
    out = []
    mark = "" if required else "?"
    title = prop.get("title")
    if isinstance(title, str):
        out.append(f"{indent}// {title}\n{indent}//\n")
    one_of = prop.get("oneOf")
    description = prop.get("description")
    if one_of is None and isinstance(description, str):
        out.append(f"{indent}// {description}\n")
    examples = prop.get("examples")
    if isinstance(examples, list) and examples:
        out.append(f"{indent}// Examples:\n")
        out.extend(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
    if isinstance(one_of, list):
        return "".join(out) + _one_of_property(key, prop, one_of, mark, indent)
    type_text = _nullable(prop, schema_to_typescript(prop, indent + "    "))
    line = f"{indent}{key}{mark}: {type_text},"
    if one_of is None and "default" in prop:
        line += f" // default: {_default(prop)}"
    out.append(line + "\n")
    return "".join(out)


def _one_of_property(key: str, prop: dict, variants: list, mark: str, indent: str) -> str:
    """A property whose type is a `oneOf`: its description above it (unless the first
    variant repeats it), then one ` | TYPE` line per variant and a lone `,`."""
    description = prop.get("description")
    description = description if isinstance(description, str) else None
    first = variants[0] if variants and isinstance(variants[0], dict) else {}
    above = description is not None and first.get("description") != description
    out = [f"{indent}// {description}\n"] if above else []
    if "default" in prop:
        out.append(f"{indent}// default: {_default(prop)}\n")
    out.append(f"{indent}{key}{mark}:\n")
    for i, variant in enumerate(variants):
        variant = variant if isinstance(variant, dict) else {}
        text = f"{indent} | " + _nullable(variant, schema_to_typescript(variant, indent + "   "))
        notes = []
        own = variant.get("description")
        if not (i == 0 and above) and isinstance(own, str) and own != description:
            notes.append(own)
        if "default" in variant:
            notes.append(f"default: {_default(variant)}")
        out.append(text + (f" // {' '.join(notes)}" if notes else "") + "\n")
    out.append(f"{indent},\n")
    return "".join(out)


def _variant(variant: Any, indent: str) -> str:
    """One variant of a top-level `oneOf`, with its description and default after it."""
    variant = variant if isinstance(variant, dict) else {}
    text = _nullable(variant, schema_to_typescript(variant, indent + "   "))
    notes = []
    if isinstance(variant.get("description"), str):
        notes.append(variant["description"])
    if "default" in variant:  # here an enum's string default keeps its quotes
        notes.append(f"default: {_default(variant, bare_enum=False)}")
    return text + (f" // {' '.join(notes)}" if notes else "")


def _nullable(schema: dict, text: str) -> str:
    return f"{text} | null" if schema.get("nullable") is True and "null" not in text else text


def _default(schema: dict, bare_enum: bool = True) -> str:
    """A default as the comment shows it: a string in quotes, unless the schema is an
    enum (then bare, as the enum's values are already quoted); anything else as JSON."""
    value = schema["default"]
    if isinstance(value, str):
        enum = schema.get("enum")
        if not (isinstance(enum, list) and enum):
            return f'"{value}"'
        if bare_enum:
            return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
