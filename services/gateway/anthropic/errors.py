"""Anthropic's error JSON: `{"type": "error", "error": {"type", "message"}}`.

The type follows the HTTP status (Anthropic's table); the gateway's error handlers build
every error of a /v1/messages route with `anthropic_error_body` (app.py), so a
validation error, a 404 for the model and an overloaded replica all come in this shape.
"""

from __future__ import annotations

from http import HTTPStatus

# HTTP status -> Anthropic's error type (anything else: api_error).
_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
    529: "overloaded_error",  # Anthropic's own "overloaded" status
}


def anthropic_error_type(status: int) -> str:
    return _TYPES.get(int(status), "invalid_request_error" if 400 <= status < 500
                      else "api_error")


def anthropic_error_body(message: str, status: int, param: str | None = None,
                         err_type: str | None = None) -> dict:
    """The body of an error answer (the gateway's ErrorFormat signature; OpenAI's
    `err_type` is not Anthropic's vocabulary and is ignored). Anthropic's errors have
    no `param`: the message names the field, which every gateway message does."""
    del param, err_type
    return {"type": "error", "error": {"type": anthropic_error_type(status),
                                       "message": message}}
