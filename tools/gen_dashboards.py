"""Generate the Grafana dashboards the Helm chart ships: charts/pagoda/dashboards/*.json.

This file is their one source of truth: edit the panels here, run
`python tools/gen_dashboards.py`, commit both. `--check` exits 1 when the JSON on
disk differs from what this file generates (tests/observability runs it, and
evaluates every panel query against a real Prometheus scraping a real cluster).

Queries use vLLM's metric names for the engine (so they also work against vLLM)
and `pagoda_*` for the gateway, router, tokenizer, kv index and worker. Per
replica means `by (instance)`: in Kubernetes each scheduler pod is its own scrape
target; locally the gateway labels each service's series with its address.
Variables: `$datasource` (a Prometheus) and `$model_name` (multi, All = `.*`).

No query falls back to a constant (`or vector(0)`): a panel reads "No data" only
when its metric is not exported. A labelled counter that would appear only on its
first event (a migration, a failed transfer, a 5xx) is exported at 0 from start-up
by the service that defines it instead, so a rate over it has a baseline.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT_DIR = Path(__file__).resolve().parent.parent / "charts" / "pagoda" / "dashboards"
RATE = "$__rate_interval"
M = 'model_name=~"$model_name"'
GEN = 'route=~"/v1/(chat/)?completions"'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (PromQL, legend)
    unit: str = "short"
    description: str = ""
    kind: str = "timeseries"  # or "stat", "table"
    width: int = 12
    height: int = 8


@dataclass
class Dashboard:
    file: str
    uid: str
    title: str
    description: str
    rows: list[list[Panel]] = field(default_factory=list)


def _select(metric: str, labels: str) -> str:
    return f"{metric}{{{labels}}}" if labels else metric


def rate(metric: str, labels: str = M, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({_select(metric, labels)}[{RATE}]))"


def quantiles(metric: str, labels: str = M, by: str = "", qs=(0.5, 0.9, 0.99)
              ) -> list[tuple[str, str]]:
    """histogram_quantile targets of a vLLM-style `_bucket` histogram."""
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    selector = _select(f"{metric}_bucket", labels)
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({selector}[{RATE}])))",
             f"{legend}p{int(q * 100)}") for q in qs]


def serving_overview() -> Dashboard:
    return Dashboard("serving-overview.json", "pagoda-serving-overview",
                     "Pagoda / Serving overview",
                     "Traffic, latency (TTFT, ITL, E2E), token throughput and errors.", [
        [Panel("Requests/s", [(rate("vllm:request_success_total"), "finished")], "reqps",
               kind="stat", width=6),
         Panel("Generation tokens/s", [(rate("vllm:generation_tokens_total"), "tokens/s")],
               "short", kind="stat", width=6),
         Panel("Running requests", [(f"sum(vllm:num_requests_running{{{M}}})", "running")],
               kind="stat", width=6),
         Panel("Waiting requests", [(f"sum(vllm:num_requests_waiting{{{M}}})", "waiting")],
               kind="stat", width=6)],
        [Panel("Finished requests/s by reason",
               [(rate("vllm:request_success_total", by="finished_reason"), "{{finished_reason}}")],
               "reqps", "stop, length, or abort (client gone or stop string)."),
         Panel("HTTP requests/s by route and status",
               [(rate("pagoda_gateway_http_requests_total", 'route!~"/metrics|/health"',
                      by="route, status"), "{{route}} {{status}}")], "reqps")],
        [Panel("Time to first token", quantiles("vllm:time_to_first_token_seconds"), "s",
               "From the gateway's arrival time to the scheduler step that produced the "
               "first token."),
         Panel("Inter-token latency", quantiles("vllm:inter_token_latency_seconds"), "s")],
        [Panel("End-to-end request latency", quantiles("vllm:e2e_request_latency_seconds"), "s"),
         Panel("Token throughput", [(rate("vllm:prompt_tokens_total"), "prompt tokens/s"),
                                    (rate("vllm:generation_tokens_total"), "generation tokens/s")],
               "short")],
        [Panel("Errors, rejections and aborts",
               [(f'sum(rate(pagoda_gateway_http_requests_total{{{GEN},status=~"5.."}}[{RATE}]))'
                 f' / sum(rate(pagoda_gateway_http_requests_total{{{GEN}}}[{RATE}]))',
                 "5xx ratio"),
                (rate("pagoda_gateway_requests_rejected_total", "", "reason"),
                 "rejected {{reason}}"),
                (rate("pagoda_gateway_requests_aborted_total", "", "route"), "aborted {{route}}")],
               "short", "Rejected: refused before generation (invalid, unauthorized, 429, 503). "
                        "Aborted: the client left before the end."),
         Panel("Request phases (p90)",
               [(q, name) for name, metric in (("queue", "vllm:request_queue_time_seconds"),
                                               ("prefill", "vllm:request_prefill_time_seconds"),
                                               ("decode", "vllm:request_decode_time_seconds"),
                                               ("inference", "vllm:request_inference_time_seconds"))
                for q, _ in quantiles(metric, qs=(0.9,))], "s")],
        [Panel("Gateway in-flight requests",
               [(f"sum by (route) (pagoda_gateway_requests_in_flight{{{GEN}}})", "{{route}}")]),
         Panel("Gateway response time (p99) by route",
               quantiles("pagoda_gateway_http_request_duration_seconds", GEN, "route", (0.99,)),
               "s", "Arrival to the last byte, streams included.")],
        [Panel("Migrations/s by reason",
               [(rate("pagoda_gateway_migrations_total", "", "reason"), "{{reason}}")], "reqps",
               "Streams moved to another replica mid-answer: replica_lost (connection or "
               "silence), replica_failed, drain_timeout. The client saw one stream."),
         Panel("LoRA adapters per replica",
               [("max by (instance, max_lora, running_lora_adapters, waiting_lora_adapters) "
                 "(vllm:lora_requests_info)", "")], kind="table",
               description="vLLM's vllm:lora_requests_info: the adapters of the running and "
                           "waiting requests (replicas started with --enable-lora).")],
        [Panel("Speculative decoding: draft acceptance rate",
               [(f"{rate('vllm:spec_decode_num_accepted_tokens_total')} / "
                 f"{rate('vllm:spec_decode_num_draft_tokens_total')}", "all positions"),
                (f"{rate('vllm:spec_decode_num_accepted_tokens_per_pos_total', by='position')}"
                 f" / on() group_left() {rate('vllm:spec_decode_num_drafts_total')}",
                 "position {{position}}")], "percentunit",
               "Drafted tokens the target model accepted (replicas started with "
               "--speculative-config); by position: how often the i-th draft of a step is "
               "accepted."),
         Panel("Speculative decoding: tokens per verify step",
               [(f"1 + {rate('vllm:spec_decode_num_accepted_tokens_total')} / "
                 f"{rate('vllm:spec_decode_num_drafts_total')}", "mean acceptance length"),
                (rate("vllm:spec_decode_num_accepted_tokens_total"), "accepted tokens/s")],
               "short", "Tokens a request gains per step in which it verified drafts "
                        "(1 = no draft accepted).")],
        [Panel("Tokenizer latency (p99)",
               quantiles("pagoda_tokenizer_latency_seconds", "", "operation", (0.99,)), "s"),
         Panel("Request sizes (p50)",
               [(quantiles("vllm:request_prompt_tokens", qs=(0.5,))[0][0], "prompt tokens"),
                (quantiles("vllm:request_generation_tokens", qs=(0.5,))[0][0],
                 "generation tokens")])],
    ])


def cache_and_routing() -> Dashboard:
    hit_rate = ("sum{by} (rate(vllm:prefix_cache_hits_total{{{m}}}[{r}])) / "
                "sum{by} (rate(vllm:prefix_cache_queries_total{{{m}}}[{r}]))")
    return Dashboard("cache-routing.json", "pagoda-cache-routing", "Pagoda / Cache & routing",
                     "KV cache usage, prefix caching, routing decisions and the cluster "
                     "prefix index.", [
        [Panel("KV cache usage per replica",
               [(f"max by (instance) (vllm:kv_cache_usage_perc{{{M}}})", "{{instance}}")],
               "percentunit"),
         Panel("Prefix cache hit rate",
               [(hit_rate.format(by="", m=M, r=RATE), "all replicas"),
                (hit_rate.format(by=" by (instance)", m=M, r=RATE), "{{instance}}")],
               "percentunit", "Prompt tokens found cached / prompt tokens looked up.")],
        [Panel("KV offload tiers: hit rate",
               [(f"{rate('pagoda_kv_offload_hits_total', by='tier')} / "
                 f"{rate('pagoda_kv_offload_queries_total', by='tier')}", "{{tier}}")],
               "percentunit",
               "Blocks onloaded from a tier / blocks looked up there (--kv-offloading-size: "
               "cpu, device misses; --kv-offloading-disk-path: disk, host misses)."),
         Panel("KV offload tiers: blocks/s",
               [(rate("pagoda_kv_offload_hits_total", by="tier"), "{{tier}} hits"),
                (rate("pagoda_kv_offload_queries_total", by="tier"), "{{tier}} queries"),
                (rate("pagoda_kv_offload_evictions_total", by="tier"), "{{tier}} evictions")],
               "short", "Evictions: blocks a full tier dropped (the host tier's go to disk "
                        "when there is one).")],
        [Panel("KV offload tiers: bytes/s",
               [(rate("pagoda_kv_offload_bytes_total", by="tier, direction"),
                 "{{tier}} {{direction}}")], "Bps",
               "offload: into the tier (disk: spilled from the host tier); onload: back "
               "into the device cache."),
         Panel("KV offload tiers: onload time per step",
               quantiles("pagoda_kv_offload_onload_seconds", "", by="tier", qs=(0.5, 0.99))
               + [(rate("pagoda_kv_offload_failed_onloads_total", "", "tier"),
                   "{{tier}} failed onloads/s")], "s",
               "The worker's copies from a tier into the device cache in one step, checks "
               "included. A failed onload (checksum, missing record) is recomputed.")],
        [Panel("Routing decisions/s by replica",
               [(rate("pagoda_router_decisions_total", "", "policy, replica"),
                 "{{policy}} -> {{replica}}")], "reqps"),
         Panel("Cached prompt tokens/s: index prediction vs replica",
               [(rate("pagoda_router_cached_tokens_total", "", "kind"), "{{kind}}")], "short",
               "What the prefix index said the chosen replica holds, against what it found. "
               "A gap is index lag or drift.")],
        [Panel("Index event lag", quantiles("pagoda_kv_index_event_lag_seconds",
                                            qs=(0.5, 0.99)), "s",
               "A KV event's creation in the scheduler to its batch being applied."),
         Panel("Index size per scheduler instance",
               [("sum by (instance_id) (pagoda_kv_index_blocks)", "{{instance_id}} blocks"),
                ("max(pagoda_kv_index_instances)", "instances with a current heartbeat")])],
        [Panel("Index intake",
               [(rate("pagoda_kv_index_events_total", "", "kind"), "{{kind}} events/s"),
                (rate("pagoda_kv_index_event_batches_total", ""), "batches/s")], "short"),
         Panel("Index health",
               [(rate("pagoda_kv_index_sequence_gaps_total", ""), "sequence gaps/s"),
                (rate("pagoda_kv_index_resyncs_total", "", "reason"), "resyncs {{reason}}/s"),
                (rate("pagoda_kv_index_dropped_batches_total", M), "dropped batches/s"),
                (rate("pagoda_kv_index_dropped_instances_total", "", "reason"),
                 "instances dropped {{reason}}/s"),
                (rate("pagoda_kv_index_redis_errors_total", "", "operation"),
                 "redis errors {{operation}}/s")], "short")],
        [Panel("Prefill/decode: KV pulled",
               [(rate("pagoda_kv_transfer_blocks_total", ""), "blocks/s"),
                ("max(pagoda_kv_leased_blocks)", "leased blocks (prefill side)")],
               "short", "Blocks decode replicas pulled from prefill replicas, and the blocks "
                        "prefill replicas hold under leases for them."),
         Panel("Prefill/decode: failures and fallbacks",
               [(rate("pagoda_kv_transfer_failures_total", "", "reason"), "failed {{reason}}"),
                (rate("pagoda_kv_transfer_fallbacks_total", "", "kind"), "fallback {{kind}}")],
               "short",
               "A pull that did not complete (timeout, lease_expired, stale_epoch, ...) is "
               "recomputed by the decode replica: the client sees no error.")],
        [Panel("Multimodal: encoder and processor cache hit rate",
               [(f"{rate('pagoda_encoder_cache_hits_total')} / "
                 f"{rate('pagoda_encoder_cache_queries_total')}", "encoder cache (worker)"),
                (f"{rate('vllm:mm_cache_hits_total', '')} / "
                 f"{rate('vllm:mm_cache_queries_total', '')}", "processor cache (tokenizer)")],
               "percentunit",
               "Media items whose encoder output (worker) or processor output (tokenizer, "
               "--mm-processor-cache-gb) was found cached. An image whose whole run is a "
               "prefix-cache hit is not looked up at all."),
         Panel("Multimodal: media fetches",
               quantiles("pagoda_tokenizer_media_fetch_seconds", "", qs=(0.5, 0.99))
               + [(rate("pagoda_tokenizer_media_fetch_failures_total", "", "reason"),
                   "failed {{reason}}/s")], "s",
               "http(s) image fetches by the tokenizer service (cache hits included), and "
               "the refused or failed ones by reason (allow-list, timeout, size, ...).")],
        [Panel("Index lookup and apply latency",
               quantiles("pagoda_kv_index_lookup_seconds", "", qs=(0.5, 0.99))
               + [(q, "apply " + legend) for q, legend in
                  quantiles("pagoda_kv_index_apply_seconds", "", qs=(0.99,))], "s"),
         Panel("Prefix pulls from a peer's KV tiers",
               [(rate("pagoda_gateway_kv_prefix_tier_pulls_total", "", "result"),
                 "gateway: pull {{result}}/s"),
                (rate("pagoda_kv_prefix_tier_leases_total", "", "result"),
                 "source: lease {{result}}/s"),
                (rate("pagoda_kv_prefix_tier_lease_blocks_total", ""),
                 "source: blocks onloaded to lease/s")], "short",
               "A replica lacking a prefix pulls it from a peer that holds it only in its "
               "host or disk tier: the peer onloads the run, then leases it. A pull that "
               "fails is recomputed (the client sees no error).")],
    ])


def capacity() -> Dashboard:
    return Dashboard("capacity.json", "pagoda-capacity", "Pagoda / Capacity",
                     "Load per replica: queue depth (the autoscaling signal), preemptions, "
                     "step sizes and times, process resources.", [
        [Panel("Running requests per replica",
               [(f"sum by (instance) (vllm:num_requests_running{{{M}}})", "{{instance}}")]),
         Panel("Waiting requests per replica",
               [(f"sum by (instance) (vllm:num_requests_waiting{{{M}}})", "{{instance}}")],
               description="Queue depth: what KEDA / the HPA scale schedulers on.")],
        [Panel("Preemptions/s per replica",
               [(rate("vllm:num_preemptions_total", by="instance"), "{{instance}}")], "short",
               "Requests evicted from the KV cache to make room (recomputed later)."),
         Panel("Queue time (p90) per replica",
               quantiles("vllm:request_queue_time_seconds", by="instance", qs=(0.9,)), "s")],
        [Panel("Tokens per engine step", quantiles("vllm:iteration_tokens_total",
                                                   qs=(0.5, 0.9))),
         Panel("Worker step time", quantiles("pagoda_worker_execute_model_seconds", "",
                                             qs=(0.5, 0.99)), "s")],
        [Panel("KV cache configuration",
               [(f"count by (instance, block_size, num_gpu_blocks) "
                 f"(vllm:cache_config_info{{{M}}})", "")], kind="table"),
         Panel("KV cache usage per replica",
               [(f"max by (instance) (vllm:kv_cache_usage_perc{{{M}}})", "{{instance}}")],
               "percentunit")],
        [Panel("CPU per process", [("sum by (instance) (rate(process_cpu_seconds_total"
                                    f"[{RATE}]))", "{{instance}}")], "percentunit"),
         Panel("Resident memory per process",
               [("sum by (instance) (process_resident_memory_bytes)", "{{instance}}")], "bytes")],
        [Panel("Service restarts (last hour)",
               [("sum by (service) (increase(pagoda_service_restarts_total[1h]))",
                 "{{service}}")], "short",
               "Services `pagoda serve` restarted after they exited (a model replica restarts "
               "its scheduler and gpu-worker together). In Kubernetes the kubelet restarts "
               "pods instead: see kube_pod_container_status_restarts_total.")],
    ])


DASHBOARDS = (serving_overview, cache_and_routing, capacity)


def _panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict:
    table = panel.kind == "table"
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                "legendFormat": legend, "range": not table, "instant": table,
                **({"format": "table"} if table else {})}
               for i, (expr, legend) in enumerate(panel.targets)]
    return {"id": panel_id, "type": panel.kind, "title": panel.title,
            "description": panel.description, "datasource": DATASOURCE,
            "gridPos": {"h": panel.height, "w": panel.width, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
            if panel.kind == "timeseries" else {},
            "targets": targets}


def _variables() -> list[dict]:
    return [
        {"name": "datasource", "label": "Prometheus", "type": "datasource",
         "query": "prometheus", "current": {}, "hide": 0},
        {"name": "model_name", "label": "Model", "type": "query", "datasource": DATASOURCE,
         "query": {"query": "label_values(vllm:num_requests_running, model_name)",
                   "refId": "model_name"},
         "definition": "label_values(vllm:num_requests_running, model_name)",
         "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2, "sort": 1,
         "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "hide": 0},
    ]


def build(dashboard: Dashboard) -> dict:
    panels, y, next_id = [], 0, 1
    for row in dashboard.rows:
        x = 0
        for panel in row:
            panels.append(_panel_json(panel, next_id, x, y))
            next_id, x = next_id + 1, x + panel.width
        y += max(p.height for p in row)
    return {"uid": dashboard.uid, "title": dashboard.title, "description": dashboard.description,
            "tags": ["pagoda", "vllm"], "timezone": "browser", "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "30s",
            "time": {"from": "now-1h", "to": "now"}, "annotations": {"list": []},
            "templating": {"list": _variables()}, "panels": panels}


def render_all() -> dict[str, str]:
    """file name -> JSON text (stable: sorted keys, 2-space indent, final newline)."""
    return {d.file: json.dumps(build(d), indent=2, sort_keys=True) + "\n"
            for d in (make() for make in DASHBOARDS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="Exit 1 if the files on disk differ from the generated ones.")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = args.out_dir / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print(f"stale dashboards (run tools/gen_dashboards.py): {', '.join(stale)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
