"""Real processes for the observability tests beside `pagoda serve` (serve_cluster.py): a
Prometheus server scraping it on loopback, and an OTLP trace collector the services export to."""

from __future__ import annotations

import json
import math
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc

from pagoda.free_ports import free_port
from serve_cluster import wait_until


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


class Prometheus:
    """A Prometheus server scraping one target every second, with `honor_labels`."""

    def __init__(self, binary: str, target: str, workdir: Path, timeout: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: pagoda\n"
            "    honor_labels: true\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if not wait_until(self._ready, timeout, 0.2):
            self.stop()
            raise RuntimeError("prometheus did not become ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited: {self.process.stderr.read()[-2000:]}")
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>; the JSON body (status 'success' or 'error')."""
        return httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30).json()

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def values(self, expr: str) -> list[float]:
        body = self.query(expr)
        assert body["status"] == "success", (expr, body)
        return [float(r["value"][1]) for r in body["data"]["result"]]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def has_number(values: list[float]) -> bool:
    return any(not math.isnan(v) for v in values)


class OtlpCollector(tpb_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: every exported span, with its service's name."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))
        tpb_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server.start()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans.extend((attrs.get("service.name", ""), s) for s in scope.spans)
        return tpb.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self._lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        self.server.stop(None)


@pytest.fixture(scope="module")
def collector():
    """An OtlpCollector for one test module's cluster to export to (stopped after it).
    A module uses it by importing the name."""
    server = OtlpCollector()
    yield server
    server.stop()


DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "pagoda" / "dashboards"


# The panels a plain colocated cluster cannot feed, each checked by the module whose
# cluster does: speculative decoding (--speculative-config, test_spec_decode_served.py) and
# prefill/decode transfers (a P/D cluster, test_dashboards_pd.py), KV offload tiers
# (--kv-offloading-size and a disk tier, test_kv_tiers_dashboard.py) and images (a LLaVA
# cluster, test_multimodal_served.py).
PANEL_PARTS = {"speculative": ("vllm:spec_decode_",),
               "pd": ("pagoda_kv_transfer_", "pagoda_kv_leased_"),
               "kv_tiers": ("pagoda_kv_offload_",),
               "multimodal": ("pagoda_encoder_cache_", "pagoda_tokenizer_media_",
                              "vllm:mm_cache_")}
# The migration panel: a colocated cluster feeds it zeros; the P/D module migrates a request.
MIGRATION_METRIC = "pagoda_gateway_migrations_"


def panel_part(expr: str) -> str:
    """"speculative", "pd", "kv_tiers" or "colocated": which cluster a panel query needs."""
    return next((part for part, metrics in PANEL_PARTS.items()
                 if any(metric in expr for metric in metrics)), "colocated")


def panel_queries(*parts: str) -> list[tuple[str, str, str]]:
    """(file, panel title, expr) of every shipped panel query of the `parts` named
    (default: "colocated", every query a colocated cluster without speculation feeds);
    "migration" selects the migration panel's."""
    parts = parts or ("colocated",)
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                if panel_part(expr) in parts or ("migration" in parts
                                                 and MIGRATION_METRIC in expr):
                    queries.append((path.name, panel["title"], expr))
    return queries


def panel_query_failures(prometheus: Prometheus, queries: list[tuple[str, str, str]],
                         model_name: str) -> list[str]:
    """The queries that fail or hold no number, with the dashboard variables set as
    Grafana would (rate interval 2m, `$model_name` = model_name)."""
    found = []
    for file, title, expr in queries:
        promql = expr.replace("$__rate_interval", "2m").replace("$model_name", model_name)
        body = prometheus.query(promql)
        if body["status"] != "success":
            found.append(f"{file} / {title}: {body.get('error')}: {promql}")
        elif not has_number([float(r["value"][1]) for r in body["data"]["result"]]):
            found.append(f"{file} / {title}: no data: {promql}")
    return found
