"""`pagoda <service>`: run one service of the cluster in this process.

Every service takes `--host` and `--port`, logs to stderr and stops cleanly on
SIGTERM; the gRPC ones also take `--metrics-port` and answer the gRPC health
protocol. The flag names are a contract (the Helm chart uses them).
"""

from __future__ import annotations

import importlib

# command -> (module with add_cli_args(parser) and main(args), help)
SERVICES = {
    "gateway": ("pagoda.services.gateway.server",
                "OpenAI-compatible HTTP API (default port 8000)."),
    "tokenizer": ("pagoda.services.tokenizer.server",
                  "Tokenizer service: encode, chat template, streaming decode (port 50051)."),
    "scheduler": ("pagoda.services.scheduler.server",
                  "One model replica's scheduler: queue, batching, KV blocks (port 50052)."),
    "gpu-worker": ("pagoda.services.gpu_worker.server",
                   "Model runner: weights, KV cache, forward and sampling (port 50053)."),
    "kv-cache-manager": ("pagoda.services.kv_cache_manager.server",
                         "Cluster prefix index in Redis (port 50054)."),
    "epp": ("pagoda.services.epp.server",
            "Endpoint picker for a Gateway API inference gateway: Envoy ext_proc (port 9002)."),
}


def add_parser(subparsers, only: str | None = None) -> None:
    """Add every service's command, or only `only`'s (importing only its module)."""
    for command, (module_name, help_text) in SERVICES.items():
        if only is not None and command != only:
            continue
        module = importlib.import_module(module_name)
        parser = subparsers.add_parser(command, help=help_text, description=help_text)
        module.add_cli_args(parser)
        parser.set_defaults(func=module.main)
