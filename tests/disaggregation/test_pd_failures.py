"""Failure semantics with real processes: a transfer that cannot finish in
--kv-transfer-timeout is recomputed by the decode replica (counted by reason), and a
dead prefill replica makes the decode replica prefill locally; the client sees no
error and the same greedy text, and no block stays leased or in use."""

from __future__ import annotations

import openai
import pytest
from pd_cluster import role_address, role_process, start_pd, usage
from serve_cluster import wait_until

pytestmark = pytest.mark.slow
PROMPT = " ".join(f"token{i}" for i in range(60))


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, redis_server):
    serve = start_pd(tiny_llama_dir, redis_server.url, "--kv-transfer-timeout", "0.000001",
                     # Long enough that a slow machine never sees the lease lapse before
                     # the pull is tried (that would count as lease_expired, not timeout).
                     "--kv-lease-timeout", "60")
    yield serve
    serve.stop()


def complete(serve, prompt=PROMPT) -> str:
    client = openai.OpenAI(base_url=serve.url, api_key="x", max_retries=0, timeout=120)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                     temperature=0.0).choices[0].text


def metric(serve, name: str, **labels) -> float:
    return sum(v for (n, ls), v in serve.scrape().items()
               if n == name and all((k, val) in ls for k, val in labels.items()))


def failures(serve) -> dict:
    """Failure counts by reason, for an assertion's message."""
    return {(n, dict(ls).get("reason") or dict(ls).get("kind")): v
            for (n, ls), v in serve.scrape().items()
            if n in ("pagoda_kv_transfer_failures_total", "pagoda_kv_transfer_fallbacks_total",
                     "pagoda_gateway_disagg_fallbacks_total", "pagoda_kv_transfer_blocks_total")}


def test_stalled_transfer_is_recomputed_and_counted(pd):
    first = complete(pd)
    assert complete(pd, "another " + PROMPT) and complete(pd, "third " + PROMPT)
    # The gateway merges the replicas' /metrics as it scrapes them: wait for the counts.
    assert wait_until(lambda: metric(pd, "pagoda_kv_transfer_failures_total",
                                     reason="timeout") == 3, 30), failures(pd)
    assert wait_until(lambda: metric(pd, "pagoda_kv_transfer_fallbacks_total",
                                     kind="recompute") == 3, 30)
    # The decode replica computed and cached the first prompt itself: nothing to pull.
    assert complete(pd) == first
    assert metric(pd, "pagoda_kv_transfer_failures_total", reason="timeout") == 3
    assert metric(pd, "pagoda_kv_transfer_blocks_total") == 0
    decode = role_address(pd, "scheduler", "kv_consumer")
    prefill = role_address(pd, "scheduler", "kv_producer")
    # Every block back in the pools (cached blocks count as free), no lease left.
    assert wait_until(lambda: usage(decode) == 0 and usage(prefill) == 0, 10)


def test_dead_prefill_replica_means_local_prefill(pd):
    want = complete(pd)
    for kind in ("scheduler", "gpu-worker"):
        role_process(pd, kind, "kv_producer").kill()
    assert complete(pd) == want
    assert complete(pd, "a prompt never seen before") != ""
