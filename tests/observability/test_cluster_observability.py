"""The whole local cluster, observed as an operator would: Prometheus scraping the gateway
(which exposes every service's metrics), the shipped Grafana dashboards' queries, the
stats log line, and one request's trace across every hop."""

from __future__ import annotations

import json
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from obs_harness import DASHBOARDS, panel_queries, panel_query_failures, total
from serve_cluster import wait_until

pytestmark = pytest.mark.slow
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches. " * 3
SERVER, CLIENT = 2, 3  # OTLP span kinds


@dataclass
class Sent:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Traffic:
    before: dict
    after: dict
    sent: list[Sent]
    num_completions: int
    num_chats: int
    num_bad: int

    def delta(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)


def _sent(usage) -> Sent:
    details = usage.prompt_tokens_details
    return Sent(usage.prompt_tokens, usage.completion_tokens,
                (details.cached_tokens or 0) if details else 0)


def _complete(client: openai.OpenAI, prompt: str, max_tokens: int) -> Sent:
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                    temperature=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    return _sent(out.usage)


def _chat_stream(client: openai.OpenAI, content: str, max_tokens: int) -> Sent:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": content}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    return _sent(chunks[-1].usage)


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"{cluster.base}/v1", api_key="unused", max_retries=0,
                       timeout=120) as client:
        yield client  # closed before the cluster stops: no idle connection delays it


@pytest.fixture(scope="module")
def traffic(cluster, client, request) -> Traffic:
    """Known traffic between two scrapes. When Prometheus runs, it has scraped the
    cluster (after a warm-up request) before the traffic starts, so every rate over
    the traffic has a baseline sample."""
    _complete(client, "warm up", 2)  # creates the series that appear on first use
    prometheus = request.getfixturevalue("prometheus")
    assert wait_until(lambda: prometheus.values("sum(pagoda_router_decisions_total)"), 30)
    before = cluster.scrape()
    sent = [_complete(client, LONG_PROMPT, 3), _complete(client, LONG_PROMPT, 5)]
    with ThreadPoolExecutor(4) as pool:
        sent += pool.map(lambda a: _complete(client, *a), [("Hello", 4), ("Once upon a", 6)])
        sent += pool.map(lambda a: _chat_stream(client, *a), [("Hi!", 3), ("Name a colour", 4)])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    http_requests = "pagoda_gateway_http_requests_total"
    expected = total(before, http_requests, method="POST") + len(sent) + 1

    def counted() -> dict | None:
        """The gateway counts a response once its last byte is sent: wait for that."""
        samples = cluster.scrape()
        return samples if total(samples, http_requests, method="POST") == expected else None
    after = wait_until(counted, 10)
    assert after, "the gateway never counted the traffic"
    return Traffic(before, after, sent, 4, 2, 1)


def test_engine_metrics_count_exactly_what_was_sent(traffic):
    t, sent = traffic, traffic.sent
    prompt, generated = sum(s.prompt_tokens for s in sent), sum(s.completion_tokens for s in sent)
    cached = sum(s.cached_tokens for s in sent)
    assert t.delta("vllm:prompt_tokens_total") == prompt
    assert t.delta("vllm:generation_tokens_total") == generated
    assert t.delta("vllm:request_success_total", finished_reason="length") == len(sent)
    assert t.delta("vllm:request_success_total", finished_reason="stop") == 0
    assert t.delta("vllm:request_success_total", finished_reason="abort") == 0
    assert t.delta("vllm:request_prompt_tokens_sum") == prompt
    assert t.delta("vllm:request_generation_tokens_sum") == generated
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_generation_tokens"):
        assert t.delta(f"vllm:{histogram}_count") == len(sent), histogram
    # One token per step per request: one inter-token gap per token after the first.
    assert t.delta("vllm:inter_token_latency_seconds_count") == generated - len(sent)
    # Each step runs the uncached prompt once, then one token per later decode.
    assert t.delta("vllm:iteration_tokens_total_sum") == prompt - cached + generated - len(sent)
    assert t.delta("vllm:prefix_cache_hits_total") == cached
    assert cached > 0, "the repeated prompt should hit the prefix cache"
    assert total(t.after, "vllm:num_requests_running") == 0
    assert total(t.after, "vllm:cache_config_info", block_size="16", model_name="tiny") == 1


def test_gateway_and_service_metrics_count_exactly(traffic):
    t = traffic
    ok = dict(status="200", method="POST")
    assert t.delta("pagoda_gateway_http_requests_total", route="/v1/completions", **ok) == 4
    assert t.delta("pagoda_gateway_http_requests_total", route="/v1/chat/completions", **ok) == 2
    assert t.delta("pagoda_gateway_http_requests_total", status="404") == t.num_bad
    assert t.delta("pagoda_gateway_requests_rejected_total", reason="invalid_request") == 1
    assert t.delta("pagoda_gateway_requests_aborted_total") == 0
    assert t.delta("pagoda_router_decisions_total") == len(t.sent)  # whatever the policy
    assert total(t.after, "pagoda_gateway_requests_in_flight", route="/v1/completions") == 0
    # Every prompt was tokenized by the tokenizer service, once.
    assert t.delta("pagoda_tokenizer_tokens_total", operation="Tokenize") == \
        sum(s.prompt_tokens for s in t.sent)
    # One Tokenize per request, plus two (with and without a salt) for each run of the
    # gateway's hash self-check (routing/block_hash_check.py) that fell in the window.
    extra = t.delta("pagoda_tokenizer_latency_seconds_count", operation="Tokenize") - len(t.sent)
    assert extra >= 0 and extra % 2 == 0, extra
    assert t.delta("pagoda_worker_execute_model_seconds_count") > 0
    assert t.delta("pagoda_kv_index_events_total", kind="stored") > 0
    assert t.delta("pagoda_kv_index_event_lag_seconds_count") > 0
    peers = {dict(ls)["service"]: v for (n, ls), v in t.after.items()
             if n == "pagoda_metrics_peer_up"}
    assert peers == {"tokenizer-0": 1, "tokenizer-1": 1, "scheduler": 1, "gpu-worker": 1,
                     "kv-cache-manager": 1,
                     "supervisor": 1}  # `pagoda serve`'s own: the restart counter


# The metric only a routing choice between two or more replicas feeds (router.py).
ONE_REPLICA_HAS_NO_LOOKUPS = "pagoda_kv_index_lookup_seconds"


def test_every_dashboard_panel_query_returns_data(traffic, prometheus):
    """Every query of every shipped dashboard, with the dashboard variables set as
    Grafana would, answers through Prometheus with at least one series holding a
    number (not only NaN); the P/D transfer panels' and speculative decoding's queries
    are checked on clusters that feed them (test_dashboards_pd.py,
    test_spec_decode_served.py)."""
    generated = total(traffic.after, "vllm:generation_tokens_total")
    assert wait_until(lambda: prometheus.values("sum(vllm:generation_tokens_total)")
                      == [generated], 30), "Prometheus never scraped the traffic"
    for path in sorted(DASHBOARDS.glob("*.json")):
        for variable in json.loads(path.read_text())["templating"]["list"]:
            if variable["type"] == "query":
                metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)",
                                             variable["definition"]).groups()
                body = prometheus.api(f"label/{label}/values", **{"match[]": metric})
                assert "tiny" in body["data"], (path.name, variable["name"], body)
    queries = panel_queries()
    assert len(queries) > 30
    # With one replica the router does not ask the prefix index (the choice is forced), so
    # the lookup-latency queries have no data here: they must still parse and run, and
    # tests/routing/test_cluster_routing.py checks two replicas do feed the histogram.
    choice_only = [q for q in queries if ONE_REPLICA_HAS_NO_LOOKUPS in q[2]]
    assert choice_only and all(prometheus.query(q[2].replace("$__rate_interval", "2m"))
                               ["status"] == "success" for q in choice_only), choice_only
    queries = [q for q in queries if q not in choice_only]

    def failures() -> list[str]:
        return panel_query_failures(prometheus, queries, "tiny")
    # Gauges refreshed periodically (the index size: after the kv-cache-manager's first
    # heartbeat timeout) may need a few more seconds to appear.
    assert wait_until(lambda: not failures(), 20, 1.0), "\n".join(failures())


def test_stats_log_line_reports_the_traffic(traffic, cluster):
    line = re.compile(r"Engine 000: Avg prompt throughput: ([\d.]+) tokens/s, Avg generation "
                      r"throughput: ([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, "
                      r"GPU KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%")
    found = wait_until(lambda: [m for m in map(line.search, cluster.log)
                                if m and float(m.group(2)) > 0], 5)
    assert found, "".join(cluster.log[-30:])


def test_client_abort_is_counted_by_gateway_and_engine(traffic, cluster):
    before = cluster.scrape()
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", f"{cluster.base}/v1/completions",
            json={"model": "tiny", "prompt": "Count:", "max_tokens": 1000, "stream": True,
                  "ignore_eos": True}) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first event, then hang up

    def aborted():
        after = cluster.scrape()
        engine = (total(after, "vllm:request_success_total", finished_reason="abort")
                  - total(before, "vllm:request_success_total", finished_reason="abort"))
        gateway = (total(after, "pagoda_gateway_requests_aborted_total")
                   - total(before, "pagoda_gateway_requests_aborted_total"))
        return (engine, gateway) == (1, 1)
    assert wait_until(aborted, 15)


def test_one_request_is_one_trace_across_every_service(traffic, cluster, collector):
    trace_id, parent_id = secrets.token_bytes(16), secrets.token_bytes(8)
    reply = httpx.post(f"{cluster.base}/v1/completions", timeout=60,
                       headers={"traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01"},
                       json={"model": "tiny", "prompt": LONG_PROMPT, "max_tokens": 3})
    assert reply.status_code == 200

    def complete():
        # Each service exports on its own batch schedule: wait for a span from every one.
        spans = collector.trace(trace_id)
        seen = {(svc, s.name) for svc, s in spans}
        return spans if {
            ("pagoda-gateway", "POST /v1/completions"),
            ("pagoda-tokenizer", "pagoda.tokenizer.v1.TokenizerService/Tokenize"),
            ("pagoda-scheduler", "scheduler.decode"),
            ("pagoda-gpu-worker", "pagoda.worker.v1.WorkerService/ExecuteModel")} <= seen else None
    spans = wait_until(complete, 30)
    assert spans, sorted({(svc, s.name) for svc, s in collector.trace(trace_id)})
    by_id = {s.span_id: (svc, s) for svc, s in spans}
    assert {svc for svc, _ in spans} >= {"pagoda-gateway", "pagoda-tokenizer",
                                         "pagoda-scheduler", "pagoda-gpu-worker"}
    roots = [s for _, s in spans if s.parent_span_id == parent_id]
    assert [(r.name, r.kind) for r in roots] == [("POST /v1/completions", SERVER)]
    assert all(s.parent_span_id in by_id for _, s in spans if s is not roots[0])

    def chain(name: str, service: str) -> list[tuple[str, str, int]]:
        """(service, span, kind) from the named span up through its ancestors."""
        svc, span = next((svc, s) for svc, s in spans if s.name == name and svc == service)
        path = [(svc.removeprefix("pagoda-"), span.name, span.kind)]
        while span.parent_span_id in by_id:
            svc, span = by_id[span.parent_span_id]
            path.append((svc.removeprefix("pagoda-"), span.name, span.kind))
        return path

    gateway_root = ("gateway", "POST /v1/completions", SERVER)
    tokenize = "pagoda.tokenizer.v1.TokenizerService/Tokenize"
    assert chain(tokenize, "pagoda-tokenizer") == [
        ("tokenizer", tokenize, SERVER), ("gateway", tokenize, CLIENT), gateway_root]
    generate, execute = ("pagoda.scheduler.v1.SchedulerService/Generate",
                         "pagoda.worker.v1.WorkerService/ExecuteModel")
    assert chain(execute, "pagoda-gpu-worker") == [
        ("gpu-worker", execute, SERVER), ("scheduler", execute, CLIENT),
        ("scheduler", "scheduler.step", 1), ("scheduler", generate, SERVER),
        ("gateway", generate, CLIENT), gateway_root]
    for phase in ("scheduler.queue", "scheduler.prefill", "scheduler.decode"):
        assert chain(phase, "pagoda-scheduler")[1] == ("scheduler", generate, SERVER)
    steps = [s for _, s in spans if s.name == "scheduler.step"]
    assert len(steps) == 3  # one prefill, two decodes for three tokens
