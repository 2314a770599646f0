"""`pagoda kv-cache-manager`: the kv-cache-manager service's process."""

from __future__ import annotations

import argparse
import logging

import redis

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.services.common import startup_clock
from pagoda.services.common.grpc_server import add_server_args, serve_sync
from pagoda.services.common.logs import setup_logging
from pagoda.services.common.redis_url import (REDIS_PASSWORD_ENV, REDIS_URL_ENV, connect,
                                              default_redis_url, redact)
from pagoda.services.kv_cache_manager.index import PrefixIndex
from pagoda.services.kv_cache_manager.metrics import kv_index_metrics
from pagoda.services.kv_cache_manager.reaper import Reaper
from pagoda.services.kv_cache_manager.servicer import KvCacheManagerServicer

DEFAULT_PORT = 50054
DEFAULT_HEARTBEAT_TIMEOUT = 10.0
SERVICE_NAME = "pagoda.kv_cache_manager.v1.KvCacheManagerService"
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument("--redis-url", default=default_redis_url("redis://127.0.0.1:6379/0"),
                        help="Redis holding the cluster prefix index (default: "
                             f"${REDIS_URL_ENV}). Give a password through ${REDIS_PASSWORD_ENV} "
                             f"(or a URL with one through ${REDIS_URL_ENV}), never here.")
    parser.add_argument("--heartbeat-timeout", type=float, default=DEFAULT_HEARTBEAT_TIMEOUT,
                        help="Seconds without a heartbeat after which an instance's entries "
                             "are dropped (schedulers beat every --kv-heartbeat-interval).")


def main(args: argparse.Namespace) -> int:
    setup_logging("kv-cache-manager")
    startup_clock.mark("imports")
    client = connect(args.redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        # Serve anyway: Redis may come up later, and callers degrade meanwhile.
        logger.warning("redis at %s is not reachable yet: %s", redact(args.redis_url), exc)
    index = PrefixIndex(client, heartbeat_timeout=args.heartbeat_timeout)
    metrics = kv_index_metrics()
    reaper = Reaper(index, metrics).start()

    def on_stop() -> None:
        reaper.stop()
        client.close()

    servicer = KvCacheManagerServicer(index, metrics)
    serve_sync("kv-cache-manager", args,
               [(pb_grpc.add_KvCacheManagerServiceServicer_to_server, servicer, SERVICE_NAME)],
               on_stop=on_stop)
    return 0
