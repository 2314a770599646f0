"""disaggregation.enabled: a prefill pool (kv_producer) and a decode pool (kv_consumer) of
engine pods, each with its own replicas, resources, batch limits, HPA/KEDA and budget, one
model, block size and dtype for both, the gateway discovering both, and decode pods
admitted to the prefill pods' gpu-worker and lease ports. Command lines are parsed by the
real CLI; the ci/ values file puts these manifests through lint and kubernetes-validate
(test_chart_render.py) and the cross-object checks (test_chart_consistency.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from chart_harness import CHART, CI_VALUES, NAMESPACE
from chart_manifests import engine_pods, flags, pods, selected_pods

VALUES = CHART / "ci" / "disaggregated-values.yaml"
POOLS = {"pagoda-prefill": "kv_producer", "pagoda-decode": "kv_consumer"}
POD_IP = "10.42.0.7"


def _parse(container: dict):
    from pagoda.services.cli.main import build_parser

    return build_parser().parse_args(container["args"])


def _role(args) -> str:
    from pagoda.kv_transfer.config import KVTransferConfig

    return KVTransferConfig.from_json(args.kv_transfer_config).kv_role


def _engines(rendered) -> dict:
    return {p.deployment: p for p in engine_pods(rendered)}


def _values_file(tmp_path, values: dict):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_the_ci_values_file_is_rendered_by_the_other_chart_tests():
    assert VALUES in CI_VALUES


def test_each_pool_carries_its_role_and_both_share_the_model_block_size_and_dtype(chart):
    rendered = chart.template(values=(VALUES,))
    engines = _engines(rendered)
    assert set(engines) == set(POOLS)  # the colocated `scheduler` Deployment is replaced
    shared = set()
    for name, role in POOLS.items():
        for service in ("scheduler", "gpu-worker"):
            args = _parse(engines[name].container(service))
            assert _role(args) == role, (name, service)
            shared.add((args.model, args.revision, args.block_size, args.dtype, args.device,
                        args.tensor_parallel_size, args.pipeline_parallel_size,
                        args.enable_prefix_caching))
    assert shared == {("Qwen/Qwen3-8B", None, 32, "bfloat16", "cuda", 1, 1, True)}

    # Batch limits are the pool's own, the same in both containers of a pod.
    for name, limits in (("pagoda-prefill", (16, 16384)), ("pagoda-decode", (256, 2048))):
        for service in ("scheduler", "gpu-worker"):
            args = _parse(engines[name].container(service))
            assert (args.max_num_seqs, args.max_num_batched_tokens) == limits


def test_colocated_by_default_with_no_kv_flags(chart):
    rendered = chart.template()
    assert set(_engines(rendered)) == {"pagoda-scheduler"}
    for c in _engines(rendered)["pagoda-scheduler"].containers:
        assert not {"kv-transfer-config", "kv-advertise-host"} & set(flags(c))


def test_pool_values_left_at_zero_take_the_schedulers(chart):
    rendered = chart.template(sets=("disaggregation.enabled=true", "scheduler.maxNumSeqs=48",
                                    "disaggregation.decode.replicas=3"))
    engines = _engines(rendered)
    for name in POOLS:
        for service in ("scheduler", "gpu-worker"):
            assert _parse(engines[name].container(service)).max_num_seqs == 48
    replicas = {d["metadata"]["name"]: d["spec"]["replicas"]
                for d in rendered.of_kind("Deployment") if d["metadata"]["name"] in POOLS}
    assert replicas == {"pagoda-prefill": 1, "pagoda-decode": 3}


def test_schedulers_get_their_roles_timeouts_and_extra_flags(chart):
    engines = _engines(chart.template(values=(VALUES,)))
    prefill = _parse(engines["pagoda-prefill"].container("scheduler"))
    decode = _parse(engines["pagoda-decode"].container("scheduler"))
    assert prefill.kv_lease_timeout == 60.0 and decode.kv_transfer_timeout == 15.0
    assert decode.execute_model_timeout == 120.0  # disaggregation.decode.extraArgs
    assert prefill.execute_model_timeout != 120.0
    assert decode.kv_advertise_host is None


def test_prefill_pods_advertise_addresses_decode_pods_may_dial(chart):
    """What a prefill scheduler puts in kv_transfer_params (kv_role.kv_addresses, with the
    pod's IP for $(POD_IP)) names its own pod's worker and scheduler ports, the worker
    listens there on every interface, and the NetworkPolicy admits decode pods there."""
    from pagoda.services.scheduler.kv_role import kv_addresses

    rendered = chart.template(values=(VALUES,))
    prefill = _engines(rendered)["pagoda-prefill"]
    scheduler = prefill.container("scheduler")
    env = {e["name"]: e for e in scheduler["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    args = _parse(scheduler)
    assert args.kv_advertise_host == "$(POD_IP)"
    args.kv_advertise_host = POD_IP  # as the kubelet expands it
    lease_address, worker_address = kv_addresses(args, args.port)
    worker = _parse(prefill.container("gpu-worker"))
    assert worker_address == f"{POD_IP}:{worker.port}" and worker.host == "0.0.0.0"
    assert lease_address == f"{POD_IP}:{args.port}"

    callers = _callers_by_port(rendered, prefill)
    assert callers[worker.port] == {"decode"}
    assert callers[args.port] == {"gateway", "decode"}
    # Decode pods keep their worker on loopback and admit only the gateway.
    decode = _engines(rendered)["pagoda-decode"]
    assert _parse(decode.container("gpu-worker")).host == "127.0.0.1"
    callers = _callers_by_port(rendered, decode)
    assert callers[args.port] == {"gateway"} and worker.port not in callers
    manager = next(p for p in pods(rendered) if p.deployment == "pagoda-kv-cache-manager")
    assert _callers_by_port(rendered, manager)[50054] == {"gateway", "prefill", "decode"}


def _callers_by_port(rendered, pod) -> dict[int, set[str]]:
    """Components admitted to each port of `pod` by pod selector (not metrics ports)."""
    out: dict[int, set[str]] = {}
    for policy in rendered.of_kind("NetworkPolicy"):
        if pod not in selected_pods(rendered, policy["spec"]["podSelector"]["matchLabels"]):
            continue
        for rule in policy["spec"]["ingress"]:
            peers = {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                     for p in rule.get("from", []) if "podSelector" in p}
            for port in rule.get("ports", [{"port": "every"}]):
                if peers:
                    out.setdefault(port["port"], set()).update(peers)
    return out


def test_the_dist_connector_reaches_both_pools_and_opens_them_to_each_other(chart):
    rendered = chart.template(values=(VALUES,),
                              sets=("disaggregation.kvConnector=PagodaDistConnector",))
    engines = _engines(rendered)
    for name, other in (("pagoda-prefill", "decode"), ("pagoda-decode", "prefill")):
        for container in ("scheduler", "gpu-worker"):
            config = json.loads(_parse(engines[name].container(container)).kv_transfer_config)
            assert config["kv_connector"] == "PagodaDistConnector"
        # The pair group's store and connections use run-time ports.
        assert _callers_by_port(rendered, engines[name])["every"] == {other}
    default = chart.template(values=(VALUES,))
    assert "every" not in _callers_by_port(default, _engines(default)["pagoda-decode"])


@pytest.mark.parametrize("discovery", ["k8s", "dns"])
def test_the_gateway_discovers_both_pools(chart, discovery):
    from pagoda.services.gateway.routing.discovery import parse_scheduler_addrs

    rendered = chart.template(values=(VALUES,),
                              sets=(f"gateway.schedulerDiscovery={discovery}",))
    (gateway,) = [p for p in pods(rendered) if p.deployment == "pagoda-gateway"]
    targets = parse_scheduler_addrs(_parse(gateway.container("gateway")).scheduler_addrs)
    found = {}
    for target in targets:
        name = target.host if target.is_k8s else target.host.split(".")[0]
        if target.is_k8s:
            assert target.k8s_namespace == NAMESPACE
        else:
            assert target.host.startswith(f"{name}.{NAMESPACE}.svc.")
        service = rendered.named("Service", name)
        assert service["spec"]["clusterIP"] == "None" and target.port == 50052
        (pod,) = selected_pods(rendered, service["spec"]["selector"])
        found[name] = pod.deployment
    assert found == {"pagoda-prefill-headless": "pagoda-prefill",
                     "pagoda-decode-headless": "pagoda-decode"}


def test_each_pool_scales_and_is_budgeted_on_its_own(chart):
    rendered = chart.template(values=(VALUES,))
    (hpa,) = rendered.of_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pagoda-prefill"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    assert hpa["spec"]["metrics"][0]["resource"]["target"]["averageUtilization"] == 75
    (scaled,) = rendered.of_kind("ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "pagoda-decode"
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (2, 12)
    trigger = scaled["spec"]["triggers"][0]["metadata"]
    assert 'service="pagoda-decode-headless"' in trigger["query"]
    assert trigger["threshold"] == "8"
    for deployment in rendered.of_kind("Deployment"):  # the autoscalers own the counts
        if deployment["metadata"]["name"] in POOLS:
            assert "replicas" not in deployment["spec"]
    budgets = {b["metadata"]["name"]: b["spec"]["maxUnavailable"]
               for b in rendered.of_kind("PodDisruptionBudget")}
    assert (budgets["pagoda-prefill"], budgets["pagoda-decode"]) == (1, "25%")
    monitors = {m["metadata"]["name"] for m in rendered.of_kind("ServiceMonitor")}
    assert {"pagoda-prefill", "pagoda-decode"} <= monitors


def test_each_pool_has_its_own_resources_and_one_gpu_per_worker(chart):
    engines = _engines(chart.template(values=(VALUES,)))
    prefill, decode = engines["pagoda-prefill"], engines["pagoda-decode"]
    assert prefill.container("gpu-worker")["resources"] == {
        "requests": {"cpu": "8", "memory": "48Gi"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 1}}
    assert decode.container("gpu-worker")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert decode.container("scheduler")["resources"]["requests"] == {"cpu": "1",
                                                                      "memory": "2Gi"}
    # Left empty: the scheduler's resources (values.yaml).
    assert prefill.container("scheduler")["resources"]["requests"] == {"cpu": "500m",
                                                                       "memory": "1Gi"}


def test_each_pool_has_its_own_tensor_parallel_size_and_gpu_count(chart):
    engines = _engines(chart.template(values=(VALUES,), sets=(
        "disaggregation.decode.tensorParallelSize=2",)))
    for name, tp in (("pagoda-prefill", 1), ("pagoda-decode", 2)):
        worker = engines[name].container("gpu-worker")
        assert f"--tensor-parallel-size={tp}" in worker["args"]
        assert f"--tensor-parallel-size={tp}" in engines[name].container("scheduler")["args"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == tp
        assert ("--distributed-executor-backend=ray" in worker["args"]) == (tp > 1)


@pytest.mark.parametrize(("settings", "message"), [
    (("disaggregation.decode.tensorParallelSize=-1",), "/disaggregation/decode"),
    (("scheduler.keda.enabled=true",), "do not apply to the prefill and decode pools"),
    (("disaggregation.kvLeaseTimeoutSeconds=10",), "must exceed kvTransferTimeoutSeconds"),
    (("disaggregation.prefill.autoscaling.enabled=true",
      "disaggregation.prefill.keda.enabled=true"), "disaggregation.prefill: enable either"),
    (("disaggregation.decode.keda.enabled=true", "disaggregation.decode.keda.minReplicas=9",
      "disaggregation.decode.keda.maxReplicas=3"), "disaggregation.decode.keda: minReplicas"),
    (("disaggregation.decode.autoscaling.enabled=true",
      "disaggregation.decode.autoscaling.targetCPUUtilizationPercentage=0"),
     "targetNumRequestsWaiting"),
    (("disaggregation.prefill.autoscaling.enabled=true", "scheduler.resources.requests=null"),
     "disaggregation.prefill.resources.requests.cpu"),
    (("disaggregation.prefill.extraArgs[0]=--block-size=32",), "set once for both pools"),
    (("disaggregation.decode.gpuWorkerExtraArgs[0]=--dtype=float16",),
     "disaggregation.decode.gpuWorkerExtraArgs: --dtype=float16"),
    (("disaggregation.decode.extraArgs[0]=--model",), "set once for both pools"),
    (("disaggregation.decode.extraArgs[0]=--prefix-caching-hash-algo=sha256_cbor",),
     "set once for both pools"),
    (("scheduler.extraArgs[0]=--kv-transfer-config={}",), "set per pool by the chart"),
    (("disaggregation.prefill.replicas=-1",), "/disaggregation/prefill/replicas"),
    (("disaggregation.decode.bogus=1",), "/disaggregation/decode"),
])
def test_contradictory_values_are_refused(chart, settings, message):
    error = chart.template_error(sets=("disaggregation.enabled=true", *settings))
    assert message in error, error


def test_pool_flags_that_may_differ_are_accepted(chart, tmp_path):
    values = {"disaggregation": {"enabled": True, "decode": {
        "extraArgs": ["--max-model-len=4096", "--scheduling-policy=priority"]}}}
    decode = _engines(chart.template(values=(_values_file(tmp_path, values),)))["pagoda-decode"]
    args = _parse(decode.container("scheduler"))
    assert (args.max_model_len, args.scheduling_policy) == (4096, "priority")
