"""The dashboards' KV offload tier panels (hit rate, blocks, bytes and onload time per
tier), on a cluster whose revisited prefixes come back from a host tier and the disk
tier below it, as an operator's Prometheus sees them.

One `pagoda serve` with a 24-block device pool, a 4-block host tier and a disk tier, a
Prometheus scraping it from before the first request, then four long prompts and their
revisits (test_kv_offload.py's workload): each revisit onloads its prefix, nearly all of
it from disk. Every query of those panels must hold a number, and the disk tier's hits
over the panel's window must cover what the traffic caused.
"""

from __future__ import annotations

import httpx
import pytest
from engine.test_kv_offload import BLOCK, TINY_BLOCK_BYTES, _prompts
from obs_harness import Prometheus, panel_queries, panel_query_failures, total
from serve_cluster import ServeProcess, wait_until

from pagoda.core.kv_disk_index import RECORD_OVERHEAD
from pagoda.core.kv_offload import GIB

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
RATE_WINDOW_S = 120  # panel_query_failures sets $__rate_interval to 2m
HITS = "pagoda_kv_offload_hits_total"


@pytest.fixture(scope="module")
def tiered(tiny_llama_dir, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-disk")
    serve = ServeProcess([
        tiny_llama_dir, "--served-model-name", "tiny", "--dtype", "float32",
        "--block-size", str(BLOCK), "--max-model-len", "256",
        "--num-gpu-blocks-override", "24", "--max-num-batched-tokens", "64",
        "--kv-offloading-size", repr(4 * TINY_BLOCK_BYTES / GIB),
        "--kv-offloading-disk-path", str(disk),
        "--kv-offloading-disk-size", repr(64 * (TINY_BLOCK_BYTES + RECORD_OVERHEAD) / GIB)])
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-60:])


def test_kv_tier_panels_show_the_onloads_per_tier(tiered, prometheus_binary, tmp_path):
    prometheus = Prometheus(prometheus_binary, tiered.base.removeprefix("http://"), tmp_path)
    try:
        # A scrape before any onload: the baseline every rate needs.
        assert wait_until(lambda: prometheus.values(f"sum({HITS})"), 30)
        first, revisits = _prompts()
        for prompt in first + revisits:  # one at a time: each evicts the earlier prefixes
            reply = httpx.post(f"{tiered.base}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
        disk_hits = total(tiered.scrape(), HITS, tier="disk")
        assert disk_hits >= 4 * 9 - 4, disk_hits  # at most the 4 host slots from memory
        queries = panel_queries("kv_tiers")
        assert len(queries) == 8 and all("cache-routing" in f for f, _, _ in queries)

        def failures() -> list[str]:
            found = panel_query_failures(prometheus, queries, "tiny")
            # The blocks panel's hits per tier, over its window: what the traffic caused.
            expr = next(e for _, title, e in queries if title == "KV offload tiers: blocks/s"
                        and HITS in e).replace("$__rate_interval", "2m").replace(
                "$model_name", "tiny")
            body = prometheus.query(expr)
            seen = {r["metric"].get("tier"): float(r["value"][1]) * RATE_WINDOW_S
                    for r in body["data"]["result"]} if body["status"] == "success" else {}
            if seen.get("disk", 0.0) < disk_hits - 1e-6:
                found.append(f"{expr}: disk {seen}, traffic caused {disk_hits}")
            return found
        assert wait_until(lambda: not failures(), 30, 1.0), "\n".join(failures())
    finally:
        prometheus.stop()
