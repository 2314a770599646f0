"""A scheduler replica's graceful exit (SIGTERM, e.g. a Kubernetes preStop + scale-down).

    SIGTERM -> NOT_SERVING (gateways stop routing here; a request that still
               arrives is refused UNAVAILABLE before acceptance, and the gateway
               retries it on another replica)
            -> in-flight requests run to the end, for up to --drain-timeout seconds;
               the streams of whatever is left then end UNAVAILABLE with the migration
               reason drain_timeout: the gateways continue those requests on other
               replicas from the tokens they already streamed (never a finish_reason
               "abort" answered with HTTP 200), and the requests are aborted here
            -> the KV publisher flushes and deregisters from the prefix index
               (server.py), the gRPC server stops, the process exits.

The metrics port stays open until the process exits: the gpu-worker's preStop
waits for it to close, so the worker outlives every step the drain still needs.
A second SIGTERM/SIGINT cuts the wait short.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)
POLL_S = 0.05
ABORT_GRACE_S = 5.0  # for the streams that were ended to close


async def drain(servicer, health_servicer, timeout: float, force: asyncio.Event) -> bool:
    """Stop taking requests and wait for the in-flight ones; True if all finished
    on their own within `timeout`."""
    servicer.draining = True
    await health_servicer.enter_graceful_shutdown()  # NOT_SERVING for every service name
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    logger.info("draining: %d requests in flight, %.0fs to finish", servicer.num_in_flight,
                timeout)
    while servicer.num_in_flight and loop.time() < deadline and not force.is_set():
        await asyncio.sleep(POLL_S)
    if not servicer.num_in_flight:
        logger.info("drained: no request in flight")
        return True
    logger.warning("drain %s: %d requests still in flight move to other replicas",
                   "cut short" if force.is_set() else "timed out", servicer.migrate_all())
    deadline = loop.time() + ABORT_GRACE_S
    while servicer.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    return False
