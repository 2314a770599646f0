"""The ci/ values files together render every template, so the schema validation of the
rendered output covers every kind the chart can produce."""

from __future__ import annotations

import re

from chart_harness import CHART, CI_VALUES

SOURCE_RE = re.compile(r"^# Source: pagoda/templates/(\S+)$", re.MULTILINE)
# Renders only when charts/pagoda/dashboards/ holds JSON files (test_chart_dashboards).
RENDERED_ELSEWHERE = {"dashboards-configmap.yaml"}


def test_ci_values_render_every_template(chart):
    rendered = set()
    for values in CI_VALUES:
        rendered |= set(SOURCE_RE.findall(chart.template(values=(values,)).text))
    templates = {p.name for p in (CHART / "templates").glob("*.yaml")}
    assert templates - rendered - RENDERED_ELSEWHERE == set()


def test_templates_are_named_component_kind():
    components = {"gateway", "tokenizer", "scheduler", "kv-cache-manager", "redis", "dashboards",
                  "epp"}
    kinds = {"deployment", "service", "secret", "pdb", "hpa", "scaledobject",
             "servicemonitor", "networkpolicy", "configmap", "serviceaccount", "role",
             "rolebinding", "inferencepool", "httproute"}
    for path in (CHART / "templates").glob("*.yaml"):
        component, _, kind = path.stem.rpartition("-")
        assert component in components and kind in kinds, path.name
