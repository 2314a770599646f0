"""The routes monitors read: GET /health, /metrics and /version.

* `/health`: 200 (empty) while the tokenizer and a routable scheduler serve and, in a
  prefill/decode cluster, a prefill and a decode replica pass their pairing check; else
  503 with `{"status": "not ready", "reason": ...}` (the probes' route: no API key, as
  auth/api_key.py lists);
* `/metrics`: this gateway's registry (every API server's, summed, under
  `--api-server-count`: multiprocess.py), or with `--peer-metrics` the whole local
  cluster's (`render_cluster_metrics`, metrics.py), in Prometheus' text format;
* `/version`: `{"version": pagoda.__version__}`.

One router for the three, registered in this order, after every other room's routes.
"""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import pagoda
from pagoda.services.gateway.observability.metrics import PeerMetrics, render_cluster_metrics
from pagoda.services.gateway.observability.multiprocess import metrics_registry


def monitoring_router(peer_metrics: list[PeerMetrics] | None,
                      scraper: httpx.AsyncClient | None) -> APIRouter:
    """`scraper`: the client that reads the peers' /metrics (None: this gateway's
    registry alone); its owner, the app's lifespan, closes it."""
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        reason = request.app.state.gateway.peers.not_ready_reason()
        if reason is None:
            return Response(status_code=200)
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    @router.get("/metrics")
    async def metrics() -> Response:
        body = (await render_cluster_metrics(peer_metrics, scraper) if scraper is not None
                else generate_latest(metrics_registry()))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
    async def version() -> dict:
        return {"version": pagoda.__version__}

    return router
