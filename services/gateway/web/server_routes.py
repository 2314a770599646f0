"""vLLM's small server routes: /ping, /load, and the models list and model cards.

* `/ping` (GET and POST): 200 while the cluster serves, 503 otherwise, like /health
  (SageMaker-style probes POST it);
* `/load`: `{"server_load": N}`, the generation and pooling requests this gateway is
  answering right now (vLLM's server load; always tracked here), counted by
  `ServerLoadMiddleware` from arrival to the response's last byte (a stream counts
  until it ends);
* `/v1/models` and `/v1/models/{model}` (OpenAI's list and retrieve): one card per
  served name, then one per LoRA adapter (vLLM's: `root` its path, `parent` the base
  model); an unknown name is a 404 in OpenAI's error JSON.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.serving_options import route_path
from pagoda.services.gateway.state import GatewayState

router = APIRouter()
# The routes whose requests count as load (vLLM's `load_aware_call` endpoints).
LOAD_AWARE_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/pooling",
    "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request) -> Response:
    state: GatewayState = request.app.state.gateway
    return Response(status_code=200 if state.peers.is_healthy() else 503)


@router.get("/load")
async def load(request: Request) -> dict:
    return {"server_load": server_load(request.app.state)}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    created = int(time.time())
    cards = [model_card(state, name, created) for name in state.model_names()]
    cards += [lora_card(state, lora, parent, created) for lora, parent in state.loras.items()]
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> dict:
    state: GatewayState = request.app.state.gateway
    for lora, parent in state.loras.items():
        if lora.lora_name == model:
            return lora_card(state, lora, parent, int(time.time()))
    if model not in state.model_names():
        raise APIError(f"The model `{model}` does not exist.", 404, param="model")
    return model_card(state, model, int(time.time()))


def model_card(state: GatewayState, name: str, created: int) -> dict:
    info = state.peers.model_info()
    return {"id": name, "object": "model", "created": created, "owned_by": "pagoda",
            "root": info.model, "parent": None, "max_model_len": info.max_model_len}


def lora_card(state: GatewayState, lora, parent: str | None, created: int) -> dict:
    """vLLM's card of an adapter: `root` its path, `parent` the base model's name."""
    card = model_card(state, lora.lora_name, created)
    card.update(root=lora.lora_path, parent=parent or state.model_names()[0])
    return card


def server_load(app_state) -> int:
    return getattr(app_state, "server_load", 0)


class ServerLoadMiddleware:
    """Counts the load-aware requests in flight in `app.state.server_load`.

    Invariant: the count goes up once when such a request arrives and down exactly
    once when its response has ended, failed, or its client left."""

    passes_body_through = True  # send: start and end only (web/direct_body.py)

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in LOAD_AWARE_PATHS:
            return await self.app(scope, receive, send)
        state = scope["app"].state
        state.server_load = server_load(state) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.server_load -= 1
