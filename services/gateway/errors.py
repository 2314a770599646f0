"""OpenAI's error JSON: `{"error": {"message", "type", "param", "code"}}`, code = HTTP status."""

from __future__ import annotations

from http import HTTPStatus

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
                 param: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param
        self.err_type = err_type or error_type(self.status)

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
    """A peer's gRPC failure as the client should see it."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    status = _GRPC_TO_HTTP.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
    if status == HTTPStatus.BAD_REQUEST:
        return APIError(details or "invalid request", status)
    return APIError(f"{peer} failed: {code.name}: {details}", status)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # vLLM answers 400 (never 422) for a malformed body.
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else \
            first.get("msg", "invalid request")
        return JSONResponse(error_body(message, 400, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {exc}", 500), status_code=500)
