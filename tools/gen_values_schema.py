"""Generate charts/pagoda/values.schema.json from the annotated charts/pagoda/values.yaml.

values.yaml is the one source of truth. For every key:
- its type is inferred from its default (mapping -> object with exactly those keys, all
  required and `additionalProperties: false`; list -> array of the first item's type);
- the comment lines right above it become its `description`;
- a `# @schema {...}` comment line above it adds JSON-schema keywords (JSON); one holding
  `$ref` replaces the inferred schema with a shared definition from DEFS below.
An empty mapping, empty list or null default must carry an annotation saying what it holds.

    python tools/gen_values_schema.py          # rewrite the schema
    python tools/gen_values_schema.py --check  # exit 1 when the schema is out of date
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "pagoda"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"

KEY_RE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w.-]*):(?:\s|$)")
COMMENT_RE = re.compile(r"^ *# ?(?P<text>.*)$")
ANNOTATION = "@schema "

# Kubernetes quantity strings ("500m", "1Gi", "2"), as in apimachinery's resource.Quantity.
QUANTITY_RE = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkKMGTPE]|[KMGTPE]i)?$"

DEFS: dict[str, Any] = {
    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
    "quantity": {"anyOf": [{"type": "string", "pattern": QUANTITY_RE},
                           {"type": "number", "minimum": 0}]},
    "quantities": {"type": "object", "additionalProperties": {"$ref": "#/$defs/quantity"}},
    "resources": {
        "type": "object", "additionalProperties": False,
        "properties": {"requests": {"$ref": "#/$defs/quantities"},
                       "limits": {"$ref": "#/$defs/quantities"}},
    },
    "stringMap": {"type": "object", "additionalProperties": {"type": "string"}},
    "stringList": {"type": "array", "items": {"type": "string"}},
    "envList": {
        "type": "array",
        "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "value"],
            "properties": {"name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                           "value": {"type": "string"}},
        },
    },
    "tolerations": {
        "type": "array",
        "items": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "key": {"type": "string"},
                "operator": {"enum": ["Exists", "Equal"]},
                "value": {"type": "string"},
                "effect": {"enum": ["", "NoSchedule", "PreferNoSchedule", "NoExecute"]},
                "tolerationSeconds": {"type": "integer", "minimum": 0},
            },
        },
    },
    "pdb": {
        "type": "object", "additionalProperties": False,
        "required": ["enabled", "maxUnavailable"],
        "properties": {
            "enabled": {"type": "boolean"},
            # 0 would block every voluntary eviction and hang node drains.
            "maxUnavailable": {"anyOf": [{"type": "integer", "minimum": 1},
                                         {"type": "string", "pattern": "^[1-9][0-9]*%$"}]},
        },
    },
    "probes": {
        "type": "object", "additionalProperties": False,
        "required": ["periodSeconds", "startupTimeoutSeconds"],
        "properties": {
            "periodSeconds": {"type": "integer", "minimum": 1},
            # The startup probe allows this long for the first healthy answer (model load).
            "startupTimeoutSeconds": {"type": "integer", "minimum": 1},
        },
    },
}


def read_annotations(text: str) -> dict[tuple[str, ...], tuple[dict, str]]:
    """Map each mapping key's path to (schema keywords, description) from its comments.

    Only block-style mappings are followed (keys inside flow mappings such as `{a: b}`
    cannot carry comments); a blank line detaches the comments above it.
    """
    found: dict[tuple[str, ...], tuple[dict, str]] = {}
    stack: list[tuple[int, str]] = []
    keywords: dict = {}
    words: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            keywords, words = {}, []
            continue
        comment = COMMENT_RE.match(line)
        if comment:
            body = comment.group("text")
            if body.startswith(ANNOTATION):
                try:
                    keywords.update(json.loads(body[len(ANNOTATION):]))
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"values.yaml:{number}: bad @schema JSON: {exc}") from exc
            else:
                words.append(body.strip())
            continue
        match = KEY_RE.match(line)
        if match:
            indent = len(match.group("indent"))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match.group("key")))
            found[tuple(key for _, key in stack)] = (keywords, " ".join(words))
        keywords, words = {}, []
    return found


def infer(value: Any, path: tuple[str, ...], notes: dict) -> dict:
    """The JSON schema of one key: inferred from its default, then annotated."""
    keywords, description = notes.get(path, ({}, ""))
    where = ".".join(path) or "<root>"
    if "$ref" in keywords:
        schema: dict[str, Any] = {}
    elif isinstance(value, dict) and value:
        schema = {
            "type": "object", "additionalProperties": False, "required": list(value),
            "properties": {k: infer(v, path + (k,), notes) for k, v in value.items()},
        }
    elif isinstance(value, list):
        schema = {"type": "array"}
        if value:
            schema["items"] = infer(value[0], path + ("[]",), notes)
        elif "items" not in keywords:
            raise SystemExit(f"{where}: empty list needs `# @schema {{\"items\": ...}}`")
    elif isinstance(value, bool):
        schema = {"type": "boolean"}
    elif isinstance(value, int):
        schema = {"type": "integer"}
    elif isinstance(value, float):
        schema = {"type": "number"}
    elif isinstance(value, str):
        schema = {"type": "string"}
    else:
        raise SystemExit(f"{where}: an empty mapping or null needs a `# @schema` type")
    if description:
        schema = {"description": description, **schema}
    schema.update(keywords)
    return schema


def build_schema() -> dict:
    text = VALUES.read_text()
    values = yaml.safe_load(text)
    notes = read_annotations(text)
    root = infer(values, (), notes)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Values of the pagoda chart (generated from values.yaml by "
                 "tools/gen_values_schema.py; do not edit)",
        **root,
        "$defs": DEFS,
    }


def render() -> str:
    return json.dumps(build_schema(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not SCHEMA.exists() or SCHEMA.read_text() != text:
            print(f"{SCHEMA.relative_to(ROOT)} is out of date: run "
                  "python tools/gen_values_schema.py", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
