"""The dashboards' prefill/decode and migration panels, on a P/D cluster that transfers KV
blocks and migrates a request, as an operator's Prometheus sees them.

One `pagoda serve --prefill-replicas 1 --decode-replicas 2` (the second decode replica is
where the migrated request continues), a Prometheus scraping it from before the first
request, a few prompts longer than a block (each pulled by a decode replica), then one
long stream whose decode replica's scheduler is SIGKILLed mid-answer. Every query of
those panels must hold a number, and the transfer and migration panels must show at
least what the traffic caused: no query falls back to `or vector(0)`, so this holds only
if every counter they read is exported at 0 before its first event (else a rate has no
sample from before it) and each panel names a metric the code exports.
"""

from __future__ import annotations

import json
import signal

import httpx
import pytest
from disaggregation.pd_cluster import role_processes, start_pd
from obs_harness import Prometheus, panel_queries, panel_query_failures, total
from serve_cluster import flag_value, scheduler_load, wait_until

from pagoda.services.common.redis_server import PrivateRedis

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
RATE_WINDOW_S = 120  # panel_query_failures sets $__rate_interval to 2m
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog while the cat "
           f"watches from the warm windowsill of the old stone house." for i in range(3)]
BLOCKS = "pagoda_kv_transfer_blocks_total"
MIGRATIONS = "pagoda_gateway_migrations_total"


@pytest.fixture(scope="module")
def pd(tiny_llama_dir):
    with PrivateRedis() as redis:
        serve = start_pd(tiny_llama_dir, redis.url, "--decode-replicas", "2")
        yield serve
        serve.stop()  # a replica was killed: its exit code is not the point here


def _running_decode_scheduler(serve):
    """The decode (kv_consumer) scheduler running a request now, or None."""
    for process in role_processes(serve, "scheduler", "kv_consumer"):
        port = flag_value(process.cmdline(), "--port")
        if scheduler_load(f"127.0.0.1:{port}").num_running > 0:
            return process
    return None


def _stream_and_kill_its_decode_replica(serve) -> dict:
    """A long greedy stream whose decode replica's scheduler is SIGKILLed once it decodes:
    the finish reason and the blocks pulled cluster-wide before the kill."""
    body = {"model": "tiny", "prompt": "Tell me a story. " * 4, "max_tokens": 600,
            "ignore_eos": True, "temperature": 0.0, "stream": True}
    finish, chunks, pulled = None, 0, None
    with httpx.Client(timeout=120) as http, \
            http.stream("POST", f"{serve.base}/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            finish = event["choices"][0]["finish_reason"] or finish
            chunks += 1
            if chunks == 5:  # past the prefill replica's first token: decoding, pulled
                victim = wait_until(lambda: _running_decode_scheduler(serve), 10, 0.02)
                assert victim is not None, "no decode replica runs the stream"
                pulled = total(serve.scrape(), BLOCKS)
                victim.send_signal(signal.SIGKILL)
    return {"finish_reason": finish, "pulled": pulled}


def test_pd_and_migration_panels_show_the_transfers_and_the_migration(pd,
                                                                       prometheus_binary,
                                                                       tmp_path):
    prometheus = Prometheus(prometheus_binary, pd.base.removeprefix("http://"), tmp_path)
    try:
        # A scrape before any transfer or migration: the baseline every rate needs.
        assert wait_until(lambda: prometheus.values("sum(vllm:num_requests_running)"), 30)
        migrated_before = total(pd.scrape(), MIGRATIONS)
        for prompt in PROMPTS:
            reply = httpx.post(f"{pd.base}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
        outcome = _stream_and_kill_its_decode_replica(pd)
        assert outcome["finish_reason"] == "length"  # the client saw one whole stream
        migrated = total(pd.scrape(), MIGRATIONS) - migrated_before
        assert migrated >= 1 and outcome["pulled"] >= len(PROMPTS), (migrated, outcome)
        queries = panel_queries("pd", "migration")
        assert len(queries) == 5

        def failures() -> list[str]:
            found = panel_query_failures(prometheus, queries, "tiny")
            # rate over the panel's window times the window: what Prometheus saw happen.
            for metric, caused in ((BLOCKS, outcome["pulled"]), (MIGRATIONS, migrated)):
                expr = next(e for _, _, e in queries if metric in e)
                promql = expr.replace("$__rate_interval", "2m")
                seen = sum(prometheus.values(promql)) * RATE_WINDOW_S
                if seen < caused - 1e-6:
                    found.append(f"{promql}: {seen:.2f} over the window, traffic caused "
                                 f"{caused}")
            return found
        assert wait_until(lambda: not failures(), 20, 1.0), "\n".join(failures())
    finally:
        prometheus.stop()
