"""The shipped dashboards are exactly what tools/gen_dashboards.py generates, well formed,
and every metric they query is one the code defines, never hidden behind `or vector(0)`
(the cluster tests, test_cluster_observability.py and test_dashboards_pd.py, then prove
each query returns data from a real Prometheus)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, ProcessCollector

from pagoda.metrics.engine_metrics import EngineMetrics
from pagoda.services.cli.supervision import RestartMetrics
from pagoda.services.common.kv_transfer_metrics import KvTransferMetrics
from pagoda.services.gateway.observability.metrics import GatewayMetrics
from pagoda.services.gpu_worker.metrics import WorkerMetrics
from pagoda.services.kv_cache_manager.metrics import KvIndexMetrics
from pagoda.services.scheduler.metrics import KvPublisherMetrics
from pagoda.services.tokenizer.metrics import TokenizerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "charts" / "pagoda" / "dashboards"
METRIC = re.compile(r"\b(vllm:[a-z0-9_:]+|pagoda_[a-z0-9_]+|process_[a-z0-9_]+)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "gauge": ("",), "info": ("_info",)}


def _generator():
    spec = importlib.util.spec_from_file_location("gen_dashboards",
                                                  ROOT / "tools" / "gen_dashboards.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def _dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def test_shipped_json_is_the_generators_output():
    generated = _generator().render_all()
    assert set(generated) == {"serving-overview.json", "cache-routing.json", "capacity.json"}
    assert {name: (DASHBOARDS / name).read_text() for name in generated} == generated
    check = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_dashboards.py"), "--check"],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_check_flags_a_hand_edited_dashboard(tmp_path):
    gen = _generator()
    assert gen.main(["--out-dir", str(tmp_path)]) == 0
    path = tmp_path / "capacity.json"
    path.write_text(path.read_text().replace("Running requests", "Running reqs"))
    assert gen.main(["--check", "--out-dir", str(tmp_path)]) == 1


def test_every_queried_metric_is_defined_by_the_code():
    registry = CollectorRegistry()
    engine = EngineMetrics("m", 1024, registry=registry)
    engine.log_cache_config(16, 1, True, 0.9)
    engine.log_lora_config(1)  # vllm:lora_requests_info, under --enable-lora
    engine.log_spec_config(2)  # vllm:spec_decode_*, under --speculative-config
    for metrics in (GatewayMetrics, TokenizerMetrics, KvIndexMetrics, WorkerMetrics,
                    KvTransferMetrics):
        metrics(registry)
    KvPublisherMetrics("m", registry)
    ProcessCollector(registry=registry)
    supervisor = RestartMetrics(["tokenizer"]).registry  # `pagoda serve`'s own
    # Sample names by family, children or not (a labelled metric shows no sample until
    # its first use, but it is defined).
    exported = {family.name + suffix for source in (registry, supervisor)
                for family in source.collect() for suffix in SUFFIXES[family.type]}
    queried = {m for d in _dashboards().values() for p in d["panels"] for t in p["targets"]
               for m in METRIC.findall(t["expr"])}
    assert queried and queried <= exported, sorted(queried - exported)


def test_no_query_hides_a_missing_metric_behind_a_constant():
    """`... or vector(0)` reads 0 whether or not its metric is exported, so the live
    checks (test_cluster_observability.py, test_dashboards_pd.py) could not catch a
    panel naming a wrong metric: a counter absent until its first event is exported at
    0 from start-up by its service instead."""
    fallbacks = [(name, p["title"], t["expr"]) for name, d in _dashboards().items()
                 for p in d["panels"] for t in p["targets"]
                 if re.search(r"\bor\s+(vector|on\s*\(\s*\)\s*vector)\s*\(", t["expr"])]
    assert not fallbacks, fallbacks


def test_dashboards_are_well_formed_grafana_models():
    uids = set()
    for name, dashboard in _dashboards().items():
        uids.add(dashboard["uid"])
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        assert variables == {"datasource", "model_name"}, name
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in dashboard["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
                assert "$model_name" not in target["expr"] or 'model_name=~"$model_name"' in \
                    target["expr"]
        assert dashboard["title"].startswith("Pagoda / "), name
    assert len(uids) == 3
