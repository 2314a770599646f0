"""`pagoda serve --kv-events-config ... --prefix-caching-hash-algo sha256_cbor`: the
scheduler's vLLM-format events reach an llm-d-style subscriber with hashes it recomputes
from the prompt's token ids, and the cluster's own Redis index holds those same hashes
(one source of events, one hash, every service agreeing)."""

from __future__ import annotations

import json

import openai
import pytest
import redis
import zmq
from serve_cluster import ServeProcess, flag_value, wait_until
from shared_clusters import PLAIN_TINY_FLAGS
from vllm_kv_subscriber import chain, check_stored_hashes, decode, low64, none_hash, replay

from pagoda.core.block_hash import hash_request_tokens
from pagoda.free_ports import free_port
from pagoda.services.common.redis_server import PrivateRedis
from pagoda.services.kv_cache_manager.index import PrefixIndex

pytestmark = pytest.mark.slow
SEED = "1234"
BS = 16


@pytest.mark.soak  # its own cluster: ~100 s on a loaded 2-core machine
def test_served_cluster_publishes_llm_d_compatible_kv_events(tiny_llama_dir, tmp_path):
    endpoint, replay_endpoint = f"ipc://{tmp_path}/kv", f"tcp://127.0.0.1:{free_port()}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay_endpoint, "topic": "kv@tiny"}
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@tiny")
    with PrivateRedis() as private_redis:
        serve = ServeProcess([tiny_llama_dir, *PLAIN_TINY_FLAGS, "--redis-url", private_redis.url,
                              "--prefix-caching-hash-algo", "sha256_cbor",
                              "--prefix-cache-hash-seed", SEED,
                              "--kv-events-config", json.dumps(config)])
        try:
            sub.connect(endpoint)
            prompt = list(range(1000, 1040))  # 2 full blocks of 16
            client = openai.OpenAI(base_url=serve.url, api_key="unused", max_retries=0,
                                   timeout=120)
            # Served at all: the gateway's start-up probe found the tokenizer's hashes
            # equal to the scheduler's (both sha256_cbor, same seed).
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
            batches: dict[int, list] = {}
            for seq, payload in replay(ctx, replay_endpoint, 0):
                batches[seq] = decode([b"kv@tiny", seq.to_bytes(8, "big"), payload],
                                      b"kv@tiny", BS)[1]
            while sub.poll(2000):  # live batches equal the replayed ones
                seq, events = decode(sub.recv_multipart(), b"kv@tiny", BS)
                assert batches.setdefault(seq, events) == events
            events = [e for seq in sorted(batches) for e in batches[seq]]
            expected = chain(prompt, BS, none_hash(SEED))
            assert set(map(low64, expected)) <= set(check_stored_hashes(events, BS, SEED))
            # Pagoda's own index was fed the same blocks under the same hashes.
            scheduler = serve.service_args("scheduler")
            instance = f"127.0.0.1:{flag_value(scheduler, '--port')}"
            assert hash_request_tokens(prompt, BS, SEED, algo="sha256_cbor") == expected
            index = PrefixIndex(redis.Redis.from_url(private_redis.url))
            assert wait_until(lambda: index.lookup(flag_value(scheduler, "--model"), BS,
                                                   expected).get(instance) == 2, timeout=10)
        finally:
            sub.close(linger=0)
            ctx.term()
            code = serve.stop()
        assert code == 0, serve.stderr_text()[-3000:]


def test_serve_refuses_a_bad_kv_events_config_before_starting_anything(tiny_llama_dir):
    with pytest.raises(RuntimeError, match="unknown key.*publishr"):
        ServeProcess([tiny_llama_dir, "--kv-events-config", '{"publishr": "zmq"}'], timeout=60)
