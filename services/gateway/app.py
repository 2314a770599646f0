"""The gateway's FastAPI app: OpenAI routes plus health, models, version, tokenize."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

import pagoda
from pagoda._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.protocol.tokenizer import chat_input_to_proto
from pagoda.services.gateway import openai_routes
from pagoda.services.gateway.errors import APIError, error_body, from_grpc_error, \
    install_error_handlers
from pagoda.services.gateway.openai_models import (DetokenizeRequest, TokenizeChatRequest,
                                                   TokenizeCompletionRequest)
from pagoda.services.gateway.peers import Peers
from pagoda.services.gateway.state import GatewayState
from pagoda.tokenizer.chat import normalize_messages


def build_app(state: GatewayState, make_peers: Callable[[], Peers]) -> FastAPI:
    """`make_peers` runs inside the server's event loop (gRPC aio channels bind to it)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.peers = make_peers()
        state.peers.start()
        yield
        await state.peers.close()

    app = FastAPI(title="Pagoda", version=pagoda.__version__, lifespan=lifespan)
    app.state.gateway = state
    install_error_handlers(app)
    app.include_router(openai_routes.router)

    @app.middleware("http")
    async def require_api_key(request: Request, call_next):
        if request.url.path.startswith("/v1/") and not state.is_authorized(
                request.headers.get("authorization")):
            return JSONResponse(error_body("Unauthorized", 401), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.peers.is_healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagoda.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        info = state.peers.model_info()
        created = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "pagoda",
             "root": info.model, "parent": None, "max_model_len": info.max_model_len}
            for name in state.model_names()]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeChatRequest | TokenizeCompletionRequest) -> dict:
        state.check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            try:
                messages = normalize_messages(body.messages)
            except ValueError as exc:
                raise APIError(str(exc), param="messages") from None
            request = tpb.TokenizeRequest(chat=chat_input_to_proto(
                messages, body.add_generation_prompt, body.continue_final_message,
                body.chat_template_kwargs), return_token_strs=body.return_token_strs)
        else:
            request = tpb.TokenizeRequest(prompt=body.prompt,
                                          add_special_tokens=body.add_special_tokens,
                                          return_token_strs=body.return_token_strs)
        reply = await openai_routes.tokenize(state, request)
        result = {"count": len(reply.token_ids), "max_model_len": state.peers.model_info()
                  .max_model_len, "tokens": list(reply.token_ids)}
        if body.return_token_strs:
            result["token_strs"] = list(reply.token_strs)
        return result

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        state.peers.tokenizer_info()
        try:
            reply = await state.peers.tokenizer.stub.Detokenize(
                tpb.DetokenizeRequest(token_ids=body.tokens, skip_special_tokens=False),
                timeout=60.0)
        except grpc.RpcError as exc:
            raise from_grpc_error(exc, "tokenizer") from None
        return {"prompt": reply.text}

    return app


def create_app(tokenizer_addr: str, scheduler_addrs: list[str],
               served_model_names: list[str] | None = None, api_key: str | None = None) -> FastAPI:
    state = GatewayState(None, list(served_model_names or []), api_key)
    return build_app(state, lambda: Peers(tokenizer_addr, scheduler_addrs))
