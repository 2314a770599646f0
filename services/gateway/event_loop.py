"""Which event loop the gateway runs on: uvloop when installed, as vLLM's API server.

Each streamed token costs the gateway a gRPC wake-up, a detokenize round trip and an
SSE write; on uvloop (libuv, in C) the loop's own share of that (ready-queue runs,
socket reads and writes, timers) is cheaper than on asyncio's pure-Python selector
loop. grpc.aio runs on either: its completion queue polls in a thread of its own and
wakes the loop through a socket the loop reads (`add_reader`), which both loops have.

Invariants:
  * `loop_name()` is "uvloop" only when uvloop imports and PAGODA_GATEWAY_UVLOOP is
    not 0; otherwise "asyncio". uvicorn's own default ("auto") would also pick uvloop,
    but silently: the gateway names its loop so a deployment without the wheel, or
    with the variable at 0, shows it in the log line `event loop: ...`.
  * The gRPC channels are made inside the running loop (app.py's lifespan), never
    before it: a grpc.aio channel is bound to the loop it was made in.
"""

from __future__ import annotations

import asyncio
import importlib.util

from pagoda import envs


def loop_name() -> str:
    """uvicorn's `loop=` setting for the gateway: "uvloop" or "asyncio"."""
    if envs.get("PAGODA_GATEWAY_UVLOOP") and importlib.util.find_spec("uvloop") is not None:
        return "uvloop"
    return "asyncio"


def running_loop_name() -> str:
    """The running loop's class, module-qualified (`uvloop.Loop`,
    `asyncio.unix_events._UnixSelectorEventLoop`): what the gateway logs at start-up."""
    loop = asyncio.get_running_loop()
    return f"{type(loop).__module__}.{type(loop).__qualname__}"
