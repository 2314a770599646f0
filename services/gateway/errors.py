"""OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`, code = HTTP status.

Another API served by the gateway (the Anthropic Messages API) may give the routes under
its path prefix their own error shape (`install_error_handlers(app, formats)`): the
handlers below build every error, whatever raised it, in the shape of the route it hit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from http import HTTPStatus

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.services.common.protocol.scheduler import SLEEPING_MESSAGE

logger = logging.getLogger(__name__)
# Seconds a client should wait before retrying a request refused for load.
RETRY_AFTER_S = 1
# gRPC status from a peer -> HTTP status the client sees.
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: HTTPStatus.BAD_REQUEST,
    grpc.StatusCode.NOT_FOUND: HTTPStatus.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    grpc.StatusCode.FAILED_PRECONDITION: HTTPStatus.SERVICE_UNAVAILABLE,
}


class APIError(Exception):
    """An error the client should see as OpenAI error JSON."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST,
                 param: str | None = None, err_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.err_type = err_type or error_type(self.status)
        self.headers = headers  # e.g. Retry-After on a 503 for load

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.err_type)


def error_type(status: int) -> str:
    if status == HTTPStatus.NOT_FOUND:
        return "NotFoundError"
    if status == HTTPStatus.UNAUTHORIZED:
        return "AuthenticationError"
    if status >= 500:
        return "InternalServerError" if status == 500 else "ServiceUnavailableError"
    return "BadRequestError"


def error_body(message: str, status: int, param: str | None = None,
               err_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type or error_type(status),
                      "param": param, "code": int(status)}}


def from_grpc_error(exc: grpc.RpcError, peer: str) -> APIError:
    """A peer's gRPC failure as the client should see it: in words, without the peer's
    address or its own error text (those go to the log), except a peer's INVALID_ARGUMENT,
    whose text is its verdict on the request. `peer`: "tokenizer", "scheduler", ...

    RESOURCE_EXHAUSTED is back-pressure (503, retry later) unless gRPC says a message
    was over its size limit: then the request is too large (413), and retrying it
    changes nothing."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or ""
    status = _GRPC_TO_HTTP.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    if status == HTTPStatus.BAD_REQUEST:
        return APIError(details or "invalid request", status)
    kind = peer.split()[0] if peer.strip() else "service"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "larger than max" in details:  # gRPC's words for a message over the size limit
            return APIError(f"The request is too large for the {kind} to accept.", 413)
        return APIError(f"The server is overloaded: {details}", status,  # our own words
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(SLEEPING_MESSAGE):
        return APIError(details, status)  # our own words: the client must wake it up
    logger.warning("%s failed: %s: %s", peer, code.name, details)
    if status == HTTPStatus.SERVICE_UNAVAILABLE:
        return APIError(f"The {kind} is not available right now; retry later.", status,
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(f"The {kind} did not answer in time.", 504)
    return APIError(f"The {kind} failed while handling the request ({code.name}).", status)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's errors: param is the top-level
    field; the message names the full path (list indices, union members)."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ())]
    if loc[:1] == ["body"]:
        loc = loc[1:]
    msg = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        error = (first.get("ctx") or {}).get("error", "")
        return f"The request body is not valid JSON: {error or msg}.", None
    if not loc:
        if first.get("type") == "missing":
            return "The request body must be a JSON object.", None
        return f"The request body must be a JSON object: {msg}", None
    return f"{'.'.join(loc)}: {msg}", loc[0]


# (message, status, param, err_type) -> an error body in one API's shape.
ErrorFormat = Callable[[str, int, "str | None", "str | None"], dict]


def install_error_handlers(app: FastAPI, formats: Mapping[str, ErrorFormat] | None = None
                           ) -> None:
    """`formats`: path prefix -> the error shape of the routes under it (default:
    OpenAI's `error_body` everywhere)."""
    formats = dict(formats or {})

    def respond(request: Request, message: str, status: int, param: str | None = None,
                err_type: str | None = None, headers: dict | None = None) -> JSONResponse:
        shape = next((f for prefix, f in formats.items()
                      if request.url.path.startswith(prefix)), error_body)
        return JSONResponse(shape(message, status, param, err_type), status_code=status,
                            headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return respond(request, exc.message, exc.status, exc.param, exc.err_type, exc.headers)

    @app.exception_handler(UnicodeEncodeError)
    async def _bad_unicode(request: Request, exc: UnicodeEncodeError) -> JSONResponse:
        # JSON may escape a lone surrogate ("\ud800"), which no UTF-8 peer accepts.
        return respond(request, "The request contains text that is not valid Unicode (an "
                       "unpaired surrogate).", 400)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # vLLM answers 400 (never 422) for a malformed body.
        message, param = validation_message(exc.errors())
        return respond(request, message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(request, str(exc.detail), exc.status_code,
                       headers=getattr(exc, "headers", None))

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        return respond(request, "The request body is nested too deeply.", 400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return respond(request, internal_error_message(exc), 500)


def internal_error_message(exc: BaseException) -> str:
    """A 500's message: what failed, in words (the exception's own text, which may name
    files, addresses or values, goes to the log only)."""
    return (f"The gateway failed while handling the request (an internal error of type "
            f"{type(exc).__name__}); the details are in its log.")
