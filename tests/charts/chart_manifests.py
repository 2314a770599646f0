"""Read rendered manifests: pods behind Deployments, label selection, container flags."""

from __future__ import annotations

import json
from dataclasses import dataclass

from chart_harness import Rendered


@dataclass(frozen=True)
class Pod:
    """The pod template of one Deployment."""

    deployment: str
    labels: dict
    spec: dict

    @property
    def containers(self) -> list[dict]:
        return self.spec["containers"]

    def container(self, service: str) -> dict:
        """The container running `pagoda <service>` (or named `service`, e.g. redis)."""
        found = [c for c in self.containers
                 if c["name"] == service or (c.get("args") or [None])[0] == service]
        assert len(found) == 1, f"{self.deployment}: no single container for {service}"
        return found[0]

    def port_numbers(self) -> set[int]:
        return {p["containerPort"] for c in self.containers for p in c.get("ports", [])}

    def declares(self, target) -> bool:
        """A Service targetPort / probe port (name or number) is declared by a container."""
        for c in self.containers:
            for p in c.get("ports", []):
                if target in (p.get("name"), p["containerPort"]):
                    return True
        return False


def pods(rendered: Rendered) -> list[Pod]:
    return [Pod(d["metadata"]["name"], d["spec"]["template"]["metadata"]["labels"],
                d["spec"]["template"]["spec"]) for d in rendered.of_kind("Deployment")]


def engine_pods(rendered: Rendered) -> list[Pod]:
    """The model replicas' pods (scheduler + gpu-worker): `<release>-scheduler`, or
    `<release>-prefill` and `<release>-decode` with disaggregation."""
    return [p for p in pods(rendered)
            if any((c.get("args") or [None])[0] == "scheduler" for c in p.containers)]


def kv_role(container: dict) -> str:
    """The --kv-transfer-config role of an engine container (kv_both when absent)."""
    config = flags(container).get("kv-transfer-config")
    return json.loads(config)["kv_role"] if config else "kv_both"


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def selected_pods(rendered: Rendered, selector: dict) -> list[Pod]:
    return [p for p in pods(rendered) if selects(selector, p.labels)]


def flags(container: dict) -> dict[str, str]:
    """`--name=value` arguments as a dict; bare `--flag` maps to ''."""
    out = {}
    for arg in container.get("args", [])[1:]:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            out[name] = value
    return out


def service_port(service: dict, number: int) -> dict:
    found = [p for p in service["spec"]["ports"] if p["port"] == number]
    assert len(found) == 1, f"Service {service['metadata']['name']} has no port {number}"
    return found[0]
