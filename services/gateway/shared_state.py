"""What the gateway keeps in process, and what its API servers (`--api-server-count N`,
api_servers.py) must therefore share. Each item's verdict, and why:

Shared (through files in the directory the parent names in `PAGODA_GATEWAY_SHARED_DIR`,
local to the one host the API servers run on):
  * stored responses (`/v1/responses`' `previous_response_id`, `GET /v1/responses/{id}`):
    a follow-up lands on any process, so the store is one SQLite file
    (openai/responses_api/shared_store.py) when there is no kv-cache-manager (else its Redis, shared by every replica), bounded by --max-stored-responses overall;
  * LoRA adapters loaded or unloaded at runtime (`/v1/load_lora_adapter`): one
    process answers the call, every process must serve the name; the registry's
    runtime changes go to a JSON file every process rereads when it changes
    (lora/registry.py). `--lora-modules` are in every process's flags anyway;
  * metrics (observability/multiprocess.py).

Per process, and correct so:
  * load per replica: the router takes the larger of what this process has in flight
    on a replica and what the replica itself reports (`GetLoad`, every second), so the
    schedulers are the source of truth and a process's own count only makes its view
    fresher between polls;
  * the prefix index: the kv-cache-manager (Redis) is the shared truth; each process's
    `RecentRoutes` only bridges the index's lag for the prompts it routed itself (a
    process that did not route a burst's first request waits for the index, as a
    second gateway pod would);
  * the herding guard, round-robin turn, session rendezvous hashing: the first two are
    statistical (each process spreads its own share), the last is a pure function of
    the session key and the replica set, equal in every process;
  * LoRA placement (which replica holds an adapter): reported by the replicas
    (`GetLoad.lora_adapters`);
  * P/D pairing checks and prefill choices: each process checks the pairs itself (the
    replicas answer the same way every time) and picks per request;
  * request ids: random (uuid4) in every process, and a client's `X-Request-Id` gets a
    random suffix on its way to a scheduler, so two processes never send the same id;
  * `--limit-concurrency` and `/load`: per process, as in vLLM (each API server has its
    own uvicorn limit and load count): the port admits up to N x the limit;
  * the gRPC channels, decode streams and in-flight streams: a process's own; when it
    dies only its connections close.
"""

from __future__ import annotations

import os

SHARED_DIR_ENV = "PAGODA_GATEWAY_SHARED_DIR"


def shared_path(name: str) -> str | None:
    """`name` inside the API servers' shared directory; None with one process."""
    directory = os.environ.get(SHARED_DIR_ENV)
    return os.path.join(directory, name) if directory else None
