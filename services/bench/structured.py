"""`pagoda bench serve --structured MODE`: every request carries one constraint.

The constraints are vLLM's `structured_outputs` request field (it works on chat and
completions, against Pagoda and vLLM alike). `json_schema` and `regex` allow long
answers, so a run with `--ignore-eos` still does about the unconstrained amount of
work per request (the grammar may end an answer early: output tokens are counted, not
assumed); `choice` answers are a few tokens each.
"""

from __future__ import annotations

from typing import Any

MODES = ("json_schema", "regex", "choice")

REPORT_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "tags": {"type": "array", "items": {"type": "string"}},
        "summary": {"type": "string"},
    },
    "required": ["title", "rating", "tags", "summary"],
}
# Unbounded: a bounded repetition such as {1,2000} compiles into a far larger automaton
# (seconds; see benchmarks/bench_structured_outputs.py).
REGEX = r"[A-Za-z0-9 ,.'-]+"
CHOICES = ["positive", "negative", "neutral", "mixed", "unclear"]


def structured_fields(mode: str | None) -> dict[str, Any]:
    """The request-body fields of `mode` ({} for none)."""
    if mode is None:
        return {}
    constraint = {"json_schema": {"json": REPORT_SCHEMA}, "regex": {"regex": REGEX},
                  "choice": {"choice": CHOICES}}[mode]
    return {"structured_outputs": constraint}
