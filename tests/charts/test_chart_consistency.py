"""Rendered manifests are consistent with themselves: Services select pods that exist and
declare the ports they target; probes, monitors, policies, autoscalers, budgets, secrets and
volumes point at things that are rendered; every service's peer address reaches a Service
whose pods run that peer."""

from __future__ import annotations

import re

import pytest
import yaml

from chart_harness import CI_VALUES, NAMESPACE
from chart_manifests import (engine_pods, flags, kv_role, pods, selected_pods, selects,
                             service_port)

pytestmark = pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)


def test_every_service_selects_pods_that_declare_its_target_ports(chart, values):
    rendered = chart.template(values=(values,))
    for svc in rendered.of_kind("Service"):
        backends = selected_pods(rendered, svc["spec"]["selector"])
        assert backends, f"Service {svc['metadata']['name']} selects no pod"
        for port in svc["spec"]["ports"]:
            for pod in backends:
                assert pod.declares(port["targetPort"]), (svc["metadata"]["name"], port)


def test_probes_use_ports_their_container_declares(chart, values):
    for pod in pods(chart.template(values=(values,))):
        for c in pod.containers:
            declared = {p["containerPort"] for p in c.get("ports", [])} | {
                p["name"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                if probe is None:
                    continue
                handler = next(probe[h] for h in ("grpc", "httpGet", "tcpSocket") if h in probe)
                assert handler["port"] in declared, (pod.deployment, c["name"], kind)
        assert all(c.get("readinessProbe") for c in pod.containers), pod.deployment


def test_autoscalers_and_budgets_target_rendered_workloads(chart, values):
    rendered = chart.template(values=(values,))
    deployments = {d["metadata"]["name"]: d for d in rendered.of_kind("Deployment")}
    for scaler in rendered.of_kind("HorizontalPodAutoscaler") + rendered.of_kind("ScaledObject"):
        ref = scaler["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["name"] in deployments, ref
        # A replica count in the Deployment would fight the autoscaler on every upgrade.
        assert "replicas" not in deployments[ref["name"]]["spec"], ref["name"]
    for pdb in rendered.of_kind("PodDisruptionBudget"):
        assert selected_pods(rendered, pdb["spec"]["selector"]["matchLabels"]), pdb["metadata"]


def test_service_monitors_select_services_and_named_ports(chart, values):
    rendered = chart.template(values=(values,))
    for monitor in rendered.of_kind("ServiceMonitor"):
        services = [s for s in rendered.of_kind("Service")
                    if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(services) == 1, monitor["metadata"]["name"]
        names = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in names, (monitor["metadata"]["name"], endpoint)


def test_network_policies_admit_callers_on_declared_ports(chart, values):
    rendered = chart.template(values=(values,))
    for policy in rendered.of_kind("NetworkPolicy"):
        targets = selected_pods(rendered, policy["spec"]["podSelector"]["matchLabels"])
        assert targets, policy["metadata"]["name"]
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert all(port["port"] in p.port_numbers() for p in targets), port
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:  # any pod of the cluster (metrics)
                    assert peer == {"namespaceSelector": {}}, peer
                    continue
                assert selected_pods(rendered, peer["podSelector"]["matchLabels"]), peer


def _backend_running(rendered, service_name: str, port: int, service: str,
                     port_name: str = "grpc") -> None:
    """service_name:port is the `port_name` port of a rendered Service whose pods run
    `pagoda <service>` on it."""
    svc = rendered.named("Service", service_name)
    assert service_port(svc, port)["name"] == port_name, (service_name, port)
    target = service_port(svc, port)["targetPort"]
    backends = selected_pods(rendered, svc["spec"]["selector"])
    assert backends
    for pod in backends:
        runner = pod.container(service)
        assert any(target in (p["name"], p["containerPort"]) for p in runner["ports"])


def test_peer_addresses_reach_the_right_services(chart, values):
    rendered = chart.template(values=(values,))
    (gateway,) = [p for p in pods(rendered) if p.deployment == "pagoda-gateway"]
    g = flags(gateway.container("gateway"))
    # dns:///<headless service>.<namespace>.svc.<domain>:<port>: every Ready tokenizer pod,
    # balanced round-robin by the gateway.
    match = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.[a-z.]+:(\d+)",
                         g["tokenizer-addr"])
    assert match, g["tokenizer-addr"]
    _backend_running(rendered, match.group(1), int(match.group(3)), "tokenizer")
    host, port = g["kv-cache-manager-addr"].rsplit(":", 1)
    _backend_running(rendered, host, int(port), "kv-cache-manager")

    # k8s://<namespace>/<headless service>:<port> (its EndpointSlices) or
    # dns:///<headless service>.<namespace>.svc.<domain>:<port>: all Ready engine pods,
    # one item per engine pool (with disaggregation: prefill and decode), comma-separated.
    reached = set()
    for item in g["scheduler-addrs"].split(","):
        match = (re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.[a-z.]+:(\d+)", item)
                 or re.fullmatch(r"k8s://(?P<ns>[a-z0-9-]+)/([a-z0-9-]+):(\d+)", item))
        assert match, g["scheduler-addrs"]
        if item.startswith("k8s://"):
            namespace, name, port = match.groups()
        else:
            name, namespace, port = match.groups()
        assert namespace == NAMESPACE
        headless = rendered.named("Service", name)
        assert headless["spec"]["clusterIP"] == "None"
        assert not headless["spec"].get("publishNotReadyAddresses", False)
        _backend_running(rendered, name, int(port), "scheduler")
        reached |= {p.deployment for p in selected_pods(rendered, headless["spec"]["selector"])}
    assert reached == {p.deployment for p in engine_pods(rendered)}  # every pool is found


def test_engine_pod_wires_scheduler_to_its_worker_and_index(chart, values):
    rendered = chart.template(values=(values,))
    for engine in engine_pods(rendered):
        s = flags(engine.container("scheduler"))
        host, port = s["worker-addr"].rsplit(":", 1)
        assert host == "127.0.0.1"  # same pod: the containers share the network namespace
        worker = engine.container("gpu-worker")
        w = flags(worker)
        declared = {p["containerPort"] for c in engine.containers for p in c["ports"]}
        if kv_role(worker) == "kv_producer":
            # Decode pods pull KV blocks from it: it listens on the pod's IP too.
            assert (w["host"], w["port"]) == ("0.0.0.0", port) and int(port) in declared
        else:
            # Loopback only: nothing outside its pod can call it, so no container port
            # is declared for it.
            assert (w["host"], w["port"]) == ("127.0.0.1", port)
            assert int(port) not in declared
        host, port = s["kv-cache-manager-addr"].rsplit(":", 1)
        _backend_running(rendered, host, int(port), "kv-cache-manager")
        # Two containers in one pod must not bind the same port.
        numbers = [p["containerPort"] for c in engine.containers for p in c["ports"]]
        assert len(numbers) == len(set(numbers))


def test_redis_url_reaches_redis(chart, values):
    rendered = chart.template(values=(values,))
    (manager,) = [p for p in pods(rendered) if p.deployment == "pagoda-kv-cache-manager"]
    container = manager.container("kv-cache-manager")
    url = flags(container).get("redis-url")
    if url is None:  # from the environment: --redis-url's default is $PAGODA_REDIS_URL
        env = {e["name"]: e for e in container["env"]}
        assert "secretKeyRef" in env["PAGODA_REDIS_URL"]["valueFrom"]
        # An external Redis: the chart must not also run its own.
        assert "pagoda-redis" not in {p.deployment for p in pods(rendered)}
        return
    match = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/0", url)
    assert match, url
    _backend_running(rendered, match.group(1), int(match.group(2)), "redis", "redis")


def _external_secret_names(values_path) -> set[str]:
    values = yaml.safe_load(values_path.read_text()) or {}
    pick = [("global", "hfTokenSecret", "name"), ("gateway", "apiKey", "existingSecret"),
            ("redis", "externalUrlSecret", "name")]
    names = set()
    for path in pick:
        node = values
        for key in path:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        if node:
            names.add(node)
    return names


def test_secret_references_resolve(chart, values):
    rendered = chart.template(values=(values,))
    secrets = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}
    external = _external_secret_names(values)
    for pod in pods(rendered):
        for c in pod.containers:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                if ref["name"] in secrets:
                    assert ref["key"] in secrets[ref["name"]]["data"], ref
                else:
                    assert ref["name"] in external, f"{pod.deployment}: {ref} is neither rendered nor given"


def test_volume_mounts_name_pod_volumes(chart, values):
    for pod in pods(chart.template(values=(values,))):
        volumes = {v["name"] for v in pod.spec.get("volumes", [])}
        for c in pod.containers:
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (pod.deployment, mount)
            # The root filesystem is read-only: every Pagoda container gets a writable /tmp.
            if c["securityContext"].get("readOnlyRootFilesystem") and c["name"] != "redis":
                assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}


def test_gateway_streams_finish_inside_the_pods_grace_period(chart, values):
    """SIGTERM reaches the gateway after its preStop sleep; --shutdown-grace-period is
    what is left of terminationGracePeriodSeconds, less 5 s for the exit itself."""
    rendered = chart.template(values=(values,))
    (gateway,) = [p for p in pods(rendered) if p.deployment == "pagoda-gateway"]
    container = gateway.container("gateway")
    sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = float(flags(container)["shutdown-grace-period"])
    assert 0 < grace and sleep + grace + 5 == gateway.spec["terminationGracePeriodSeconds"]


def test_tokenizer_pods_are_replicated_behind_a_headless_service_and_a_budget(chart, values):
    """One tokenizer pod's death or eviction must fail no request: the gateway needs a
    second pod, every pod's address (headless DNS), and a budget that keeps one up."""
    rendered = chart.template(values=(values,))
    (deployment,) = [d for d in rendered.of_kind("Deployment")
                     if d["metadata"]["name"] == "pagoda-tokenizer"]
    scalers = [h for h in rendered.of_kind("HorizontalPodAutoscaler")
               if h["spec"]["scaleTargetRef"]["name"] == "pagoda-tokenizer"]
    replicas = scalers[0]["spec"]["minReplicas"] if scalers else deployment["spec"]["replicas"]
    assert replicas >= 2
    (service,) = [s for s in rendered.of_kind("Service")
                  if s["metadata"]["name"] == "pagoda-tokenizer"]
    assert service["spec"]["clusterIP"] == "None"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    budgets = [b for b in rendered.of_kind("PodDisruptionBudget")
               if selects(b["spec"]["selector"]["matchLabels"], labels)]
    assert budgets and budgets[0]["spec"]["maxUnavailable"] == 1
