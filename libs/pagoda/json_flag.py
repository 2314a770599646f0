"""Flags that take a JSON object (vLLM's `--speculative-config '{...}'` and its kind)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def json_object(value: str | Mapping[str, Any] | None, flag: str) -> dict[str, Any] | None:
    """The flag's value as a dict: JSON text is parsed, a mapping is copied; None or ""
    gives None. ValueError naming `flag` (e.g. "--speculative-config") when the text is
    not JSON or not an object."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{flag} must be a JSON object")
    return dict(value)
