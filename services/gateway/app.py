"""The gateway's FastAPI app, wired: every room's routes and middleware, in their order.

No route is defined here; each lives in its room (see README.md's map).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import httpx
from fastapi import FastAPI

import pagoda
from pagoda.services.common import startup_clock
from pagoda.services.gateway.anthropic import routes as anthropic_routes
from pagoda.services.gateway.anthropic.errors import anthropic_error_body
from pagoda.services.gateway.auth.api_key import APIKeyMiddleware
from pagoda.services.gateway.disagg.prefill_decode import disaggregation_of
from pagoda.services.gateway.disagg.prefix_pull import PrefixPull, PrefixPullOptions
from pagoda.services.gateway.errors import install_error_handlers
from pagoda.services.gateway.event_loop import running_loop_name
from pagoda.services.gateway.limits.body_limit import BodySizeLimitMiddleware
from pagoda.services.gateway.lora import routes as lora_routes
from pagoda.services.gateway.lora.registry import LoRARegistry
from pagoda.services.gateway.observability.http_metrics import HttpMetricsMiddleware
from pagoda.services.gateway.observability.metrics import ObservabilityMiddleware, PeerMetrics
from pagoda.services.gateway.observability.routes import monitoring_router
from pagoda.services.gateway.openai import routes as openai_routes
from pagoda.services.gateway.openai import tokenize_routes
from pagoda.services.gateway.openai.responses_api import routes as responses_api
from pagoda.services.gateway.pooling import cohere_embed
from pagoda.services.gateway.pooling import routes as pooling_routes
from pagoda.services.gateway.routing.context import RoutingHeaderMiddleware
from pagoda.services.gateway.routing.peers import Peers
from pagoda.services.gateway.routing.router import DEFAULT_POLICY
from pagoda.services.gateway.serving_options import ServingOptions
from pagoda.services.gateway.sleep import routes as sleep_routes
from pagoda.services.gateway.state import GatewayState
from pagoda.services.gateway.web import server_routes
from pagoda.services.gateway.web.direct_body import GatewayApp
from pagoda.services.gateway.web.cors_request_id import HttpOptions, install_http_middleware

logger = logging.getLogger(__name__)


def build_app(state: GatewayState, make_peers: Callable[[], Peers],
              peer_metrics: list[PeerMetrics] | None = None,
              kv_cache_manager_addr: str | None = None,
              http_options: HttpOptions | None = None) -> FastAPI:
    """`make_peers` runs inside the server's event loop (gRPC aio channels bind to it).
    `peer_metrics`: services whose /metrics the gateway's /metrics includes;
    `kv_cache_manager_addr`: the router's prefix index (None: routing by load only);
    `http_options`: CORS settings (default: vLLM's, everything allowed)."""
    scraper = httpx.AsyncClient() if peer_metrics else None

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        logger.info("event loop: %s", running_loop_name())  # event_loop.py: uvloop or not
        state.peers = make_peers()
        if kv_cache_manager_addr:
            state.peers.use_prefix_index(kv_cache_manager_addr)
        disaggregation_of(state.peers)  # its pairing check gates readiness from the start
        state.peers.start()
        startup_clock.mark("HTTP server")
        startup_clock.report("listening")  # serving needs its peers: the cluster's /health
        lora_check = asyncio.create_task(
            lora_routes.check_static_adapters(state, state.peers.on_fatal))
        yield
        lora_check.cancel()
        await state.peers.close()
        if scraper is not None:
            await scraper.aclose()

    # GatewayApp: streamed body chunks skip the middleware (web/direct_body.py)
    app = GatewayApp(title="Pagoda", version=pagoda.__version__, lifespan=lifespan)
    app.state.gateway = state
    # Every error under /v1/messages in Anthropic's shape, OpenAI's elsewhere.
    install_error_handlers(app, {anthropic_routes.PATH_PREFIX: anthropic_error_body})
    app.include_router(openai_routes.router)
    app.include_router(responses_api.router)  # /v1/responses
    app.include_router(anthropic_routes.router)  # /v1/messages[/count_tokens]
    app.include_router(server_routes.router)  # /ping, /load, /v1/models[/{model}]
    app.add_middleware(server_routes.ServerLoadMiddleware)  # counts authorized requests
    app.include_router(pooling_routes.router)  # embeddings, score, rerank, classify
    app.include_router(cohere_embed.router)  # /v2/embed
    if state.loras.runtime_updates:  # vLLM serves these only when allowed
        app.include_router(lora_routes.router)  # /v1/load_lora_adapter, /v1/unload_...
    if state.options.enable_sleep_mode:  # vLLM serves these only with the flag (dev mode)
        app.include_router(sleep_routes.router)  # /sleep, /wake_up, /is_sleeping

    # Inside the API-key check (a caller without the key is refused before its body is
    # read); outside everything that parses the body.
    app.add_middleware(BodySizeLimitMiddleware,
                       max_bytes=state.options.limits.max_request_body_bytes)
    app.add_middleware(APIKeyMiddleware, state=state)
    app.add_middleware(RoutingHeaderMiddleware)  # X-Session-Id in, X-Pagoda-Instance out
    # Added after the API-key check, so it wraps it: it counts (and traces) 401s too.
    app.add_middleware(ObservabilityMiddleware)
    app.add_middleware(HttpMetricsMiddleware)  # http_requests_total etc. (vLLM's names)
    install_http_middleware(app, http_options)  # CORS and X-Request-Id wrap everything
    app.include_router(monitoring_router(peer_metrics, scraper))  # /health, /metrics, /version
    app.include_router(tokenize_routes.router)  # /tokenize, /detokenize

    return app


def create_app(tokenizer_addr: str, scheduler_addrs: list[str],
               served_model_names: list[str] | None = None, api_key: str | None = None,
               kv_cache_manager_addr: str | None = None,
               peer_metrics: list[PeerMetrics] | None = None,
               http_options: HttpOptions | None = None, router: str = DEFAULT_POLICY,
               on_fatal: Callable[[str], None] | None = None,
               options: ServingOptions | None = None,
               kv_medium_weights: dict[str, float] | None = None,
               loras: LoRARegistry | None = None,
               prefix_pull: PrefixPullOptions | None = None) -> FastAPI:
    """`router`: the routing policy; `on_fatal`: called if the cluster cannot be
    served correctly (block hashes disagree, a --lora-modules adapter cannot run);
    `options`: vLLM's serving flags (serving_options.py; default: vLLM's defaults);
    `loras`: the adapters served by name (lora/registry.py; default: none);
    `prefix_pull`: --kv-prefix-pull (disagg/prefix_pull.py; default: off);
    `kv_medium_weights`: --kv-medium-weights (routing/router.py; default: its defaults)."""
    state = GatewayState(None, list(served_model_names or []), api_key,
                         options or ServingOptions(), loras or LoRARegistry())

    def make_peers() -> Peers:
        peers = Peers(tokenizer_addr, scheduler_addrs, router, on_fatal=on_fatal)
        peers.router.medium_weights.update(kv_medium_weights or {})
        if prefix_pull is not None and prefix_pull.enabled:
            peers.prefix_pull = PrefixPull(peers, prefix_pull)
            peers.router.lookup_single_replica = True  # the pull reads Route.prefix
        return peers

    return build_app(state, make_peers, peer_metrics, kv_cache_manager_addr, http_options)
