"""Every charts/pagoda/dashboards/*.json ships as one ConfigMap for Grafana's sidecar, holding
the dashboard as valid JSON; no JSON files render no ConfigMaps."""

from __future__ import annotations

import json
import shutil

from chart_harness import CHART, kubernetes_validate, KUBE_VERSIONS

CONFIGMAP_LIMIT = 1 << 20  # bytes: the API server rejects larger ConfigMaps


def _dashboard_maps(rendered) -> list[dict]:
    return [d for d in rendered.of_kind("ConfigMap")
            if d["metadata"]["labels"].get("app.kubernetes.io/component") == "dashboards"]


def test_one_configmap_of_valid_json_per_shipped_dashboard(chart):
    files = sorted((CHART / "dashboards").glob("*.json"))
    maps = _dashboard_maps(chart.template())
    assert len(maps) == len(files)
    by_key = {key: text for m in maps for key, text in m["data"].items()}
    assert set(by_key) == {f.name for f in files}
    for path in files:
        assert json.loads(by_key[path.name]) == json.loads(path.read_text())
        assert len(path.read_bytes()) < CONFIGMAP_LIMIT, path.name


def test_a_dashboard_file_becomes_a_labelled_configmap(chart, tmp_path):
    copy = tmp_path / "pagoda"
    shutil.copytree(CHART, copy)
    for old in (copy / "dashboards").glob("*.json"):
        old.unlink()
    dashboard = {"title": "Serving overview", "uid": "pagoda-serving", "panels": [
        {"type": "timeseries", "title": "TTFT p99", "targets": [{"expr":
         'histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))'}]}]}
    text = json.dumps(dashboard, indent=2)
    (copy / "dashboards" / "Serving_Overview.json").write_text(text)

    rendered = chart.template(chart=copy, sets=("global.dashboards.annotations.grafana_folder=Pagoda",))
    (cm,) = _dashboard_maps(rendered)
    assert cm["metadata"]["name"] == "pagoda-dashboard-serving-overview"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Pagoda"}
    assert json.loads(cm["data"]["Serving_Overview.json"]) == dashboard

    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(rendered.text)
    for version in KUBE_VERSIONS:
        out = kubernetes_validate(manifest, version)
        assert out.returncode == 0, out.stdout + out.stderr

    assert not _dashboard_maps(chart.template(chart=copy, sets=("global.dashboards.enabled=false",)))
