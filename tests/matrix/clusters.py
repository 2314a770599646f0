"""The served clusters of the matrix, one `pagoda serve` command line each, started with
the suite's own harnesses (serve_cluster.ServeProcess, pd_cluster.start_pd) and the
served flags of the reference (shared_clusters.PLAIN_TINY_FLAGS)."""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Iterator

import httpx
from pd_cluster import start_pd
from serve_cluster import ServeProcess, flag_value, wait_until
from shared_clusters import PLAIN_TINY_FLAGS

from pagoda.services.common.redis_server import PrivateRedis
from pagoda.services.gateway.routing.router import _rendezvous

DIST_PD = ["--kv-connector", "PagodaDistConnector", "--distributed-executor-backend", "mp"]
# Lookup from one token: the random model's answers rarely repeat two tokens of their
# prompt, but the JSON and tool answers repeat single tokens (whitespace, quotes), so the
# proposer drafts there (the row checks that it did).
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
# 48 blocks of 16 tokens: the longest request (~470 prompt tokens, 30 blocks) fits alone,
# the request set sent at once (~70 blocks) does not: the scheduler must preempt.
SMALL_POOL_BLOCKS = 48


@contextlib.contextmanager
def served(model_dir: str, *extra: str, pd: bool = False,
           env: dict[str, str] | None = None) -> Iterator[ServeProcess]:
    """`pagoda serve MODEL PLAIN_TINY_FLAGS EXTRA` (P/D: 1 prefill + 1 decode replica) on
    a Redis of its own, stopped after use; `env`: added to the serve's environment."""
    with PrivateRedis() as redis:
        if pd:
            serve = start_pd(model_dir, redis.url, *extra)
        else:
            serve = ServeProcess([model_dir, *PLAIN_TINY_FLAGS, "--redis-url", redis.url,
                                  *extra], env=env, timeout=300)
        try:
            yield serve
        except BaseException:
            # The cluster's own account of a failed path (pytest shows captured stderr).
            print("".join(serve.log[-80:]), file=sys.stderr)
            raise
        finally:
            serve.stop()


def session_keys(serve: ServeProcess) -> list[str]:
    """An X-Session-Id per replica (in --scheduler-addrs order) that `--router session`
    sends there (its rendezvous hash), once every replica answers through the gateway."""
    addresses = flag_value(serve.service_args("gateway"), "--scheduler-addrs").split(",")
    keys: dict[int, str] = {}
    for i in range(200):
        key = f"user{i}"
        keys.setdefault(max(range(len(addresses)),
                            key=lambda r: _rendezvous(key, addresses[r])), key)
    ordered = [keys[r] for r in range(len(addresses))]

    def routed(replica: int) -> bool:
        reply = httpx.post(f"{serve.url}/completions", timeout=60,
                           headers={"X-Session-Id": ordered[replica]},
                           json={"model": "tiny", "prompt": [1, 2], "max_tokens": 1})
        return reply.headers.get("x-pagoda-instance") == addresses[replica]

    for replica in range(len(addresses)):
        assert wait_until(lambda: routed(replica), 60, 0.5), f"replica {replica} never served"
    return ordered


def spec_flags(config: dict) -> list[str]:
    return ["--speculative-config", json.dumps(config)]
