"""The request fields that constrain an answer, turned into one `StructuredOutputsParams`.

Accepted, as vLLM accepts them:
  * `response_format`: {"type": "text" | "json_object" | "json_schema" | "structural_tag"},
    a json_schema with its `schema` (plus `name`, `description`, `strict`, which do
    not change the grammar);
  * `structured_outputs`: {json | regex | choice | grammar | json_object | structural_tag,
    disable_any_whitespace} (vLLM's request field);
  * the older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
  * a forced tool choice (tools.py), which is a JSON schema too.
At most one constraint per request, else a 400 naming both fields. The shape is
checked here; whether the grammar backend accepts the constraint is the scheduler's
check (its reason comes back as a 400 too).
"""

from __future__ import annotations

from typing import Any

from pagoda.sampling_params import STRUCTURED_OUTPUT_KINDS, StructuredOutputsParams
from pagoda.services.gateway.errors import APIError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# vLLM's StructuredOutputsParams options that change nothing when left at their defaults.
_IGNORED_WHEN_UNSET = ("disable_fallback", "disable_additional_properties",
                       "whitespace_pattern")


def request_structured_outputs(body: Any, tool_constraint: dict[str, Any] | None = None
                               ) -> StructuredOutputsParams | None:
    """The one constraint of `body` (None: free text). Raises APIError (400)."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = _response_format(getattr(body, "response_format", None))
    if response_format is not None:
        found.append(("response_format", response_format))
    explicit = getattr(body, "structured_outputs", None)
    if explicit is not None:
        found.append(("structured_outputs", _explicit(explicit)))
    for field, kind in GUIDED.items():
        value = getattr(body, field, None)
        if value is not None:
            found.append((field, {kind: value}))
    if tool_constraint is not None:
        found.append(("tool_choice", tool_constraint))
    if len(found) > 1:
        raise APIError(f"Only one kind of structured output may be given per request; got "
                       f"{' and '.join(name for name, _ in found)}.", param=found[1][0])
    if not found:
        return None
    param, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise APIError(str(exc), param=param) from None


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError("response_format must be an object with a 'type'.", param="response_format")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if schema is None:
            raise APIError("response_format of type 'json_schema' needs json_schema.schema "
                           "(the JSON schema of the answer).", param="response_format")
        return {"json": schema}
    if kind == "structural_tag":
        return {"structural_tag": {k: v for k, v in value.items()}}
    raise APIError(f"response_format type must be text, json_object, json_schema or "
                   f"structural_tag, got {kind!r}.", param="response_format")


def _explicit(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise APIError("structured_outputs must be an object.", param="structured_outputs")
    kwargs = dict(value)
    for key in _IGNORED_WHEN_UNSET:
        if not kwargs.get(key):
            kwargs.pop(key, None)
    known = (*STRUCTURED_OUTPUT_KINDS, "disable_any_whitespace")
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise APIError(f"structured_outputs: {', '.join(unknown)} is not supported (Pagoda "
                       f"takes {', '.join(known)}).", param="structured_outputs")
    return kwargs
