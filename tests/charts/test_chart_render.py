"""charts/pagoda lints strictly and renders, for every ci/ values file, manifests that
Kubernetes' own schemas accept (kubernetes-validate --strict, offline)."""

from __future__ import annotations

import re

import pytest

from chart_harness import CHART, CI_VALUES, CRD_KINDS, KUBE_VERSIONS, kubernetes_validate

pytestmark = pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)

WARN_RE = re.compile(r"Couldn't find schema for kind (\S+) with api version (\S+)")


def test_helm_lint_strict(chart, values):
    out = chart.run("lint", "--strict", str(CHART), "-f", str(values))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_rendered_manifests_pass_kubernetes_validate(chart, values, kube_version, tmp_path):
    rendered = chart.template(values=(values,))
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(rendered.text)
    out = kubernetes_validate(manifest, kube_version)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report
    assert "ERROR" not in report, report
    # A schema can be missing only for the custom resources; an unknown built-in
    # kind or apiVersion (e.g. a removed autoscaling/v2beta2) would show up here.
    missing = {(api, kind) for kind, api in WARN_RE.findall(report)}
    assert missing <= CRD_KINDS, report
    assert {(d["apiVersion"], d["kind"]) for d in rendered.docs} & CRD_KINDS == missing


def test_every_document_is_a_named_object(chart, values):
    rendered = chart.template(values=(values,))
    seen = set()
    for doc in rendered.docs:
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in seen, f"duplicate {key}"
        seen.add(key)
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        assert len(doc["metadata"]["name"]) <= 63
