"""`pagoda gateway`: the OpenAI-compatible HTTP server (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from pagoda.services.common.logs import setup_logging

DEFAULT_PORT = 8000
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="Listen address.")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port.")
    parser.add_argument("--tokenizer-addr", default="127.0.0.1:50051",
                        help="host:port of the tokenizer service.")
    parser.add_argument("--scheduler-addrs", default="127.0.0.1:50052",
                        help="Comma-separated host:port of the scheduler replicas.")
    parser.add_argument("--kv-cache-manager-addr", default="127.0.0.1:50054",
                        help="host:port of the kv-cache-manager (used by the KV-aware router).")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Names clients may use for the model (default: the scheduler's).")
    parser.add_argument("--api-key", default=os.environ.get("PAGODA_API_KEY"),
                        help="Require `Authorization: Bearer KEY` on /v1/* "
                             "(default: $PAGODA_API_KEY).")


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from pagoda.services.gateway.app import create_app

    setup_logging("gateway")
    schedulers = [a.strip() for a in args.scheduler_addrs.split(",") if a.strip()]
    app = create_app(args.tokenizer_addr, schedulers, args.served_model_name, args.api_key)
    logger.info("gateway on http://%s:%d (tokenizer %s, schedulers %s)", args.host, args.port,
                args.tokenizer_addr, ", ".join(schedulers))
    # uvicorn handles SIGTERM/SIGINT itself (stop accepting, finish in-flight requests,
    # run the lifespan exit), then re-raises the signal to the handler it found: make
    # that one a no-op so a clean shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_graceful_shutdown=5, access_log=False)
    logger.info("gateway stopped")
    return 0
