"""inferencePool.enabled: the chart renders an InferencePool and an HTTPRoute that validate
against charts/schemas/ (written from GIE v1.0 and Gateway API v1.3), with `pagoda epp` as
the picker (its Deployment and Service, the pool's endpointPickerRef naming them) or an
external one (none of ours rendered, the ref naming it); every scheduler pod that serves
whole requests runs the member gateway at the pool's target port, and the picker maps
the schedulers to that port."""

from __future__ import annotations

import json

import jsonschema
import pytest

from chart_harness import CHART, ROOT

SCHEMAS = ROOT / "charts" / "schemas"
POOL_VALUES = CHART / "ci" / "inference-pool-values.yaml"
DISAGG_VALUES = CHART / "ci" / "disaggregated-values.yaml"
EXTERNAL = ("inferencePool.endpointPicker.external.name=llm-d-epp",
            "inferencePool.endpointPicker.external.port=9102",
            "inferencePool.endpointPicker.failureMode=FailOpen")


def validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


POOL = validator("inferencepool.inference.networking.k8s.io.v1.json")
ROUTE = validator("httproute.gateway.networking.k8s.io.v1.json")


def errors(v: jsonschema.Draft202012Validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in v.iter_errors(doc)]


def pool_and_route(rendered) -> tuple[dict, dict]:
    (pool,) = rendered.of_kind("InferencePool")
    (route,) = rendered.of_kind("HTTPRoute")
    assert errors(POOL, pool) == [] and errors(ROUTE, route) == []
    return pool, route


def container(deployment: dict, name: str) -> dict:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                if c["name"] == name]
    return found


def test_pool_with_pagoda_epp(chart):
    rendered = chart.template(values=(POOL_VALUES,))
    pool, route = pool_and_route(rendered)
    spec = pool["spec"]
    epp_service = rendered.named("Service", "pagoda-epp")
    epp = rendered.named("Deployment", "pagoda-epp")
    assert spec["endpointPickerRef"] == {"kind": "Service", "name": "pagoda-epp",
                                         "port": {"number": 9002}, "failureMode": "FailClose"}
    assert {p["port"] for p in epp_service["spec"]["ports"]} == {9002, 9090}
    args = container(epp, "epp")["args"]
    assert args[0] == "epp" and "--target-port=8000" in args
    assert any(a.startswith("--scheduler-addrs=dns:///pagoda-scheduler-headless.") for a in args)
    # The pool selects the scheduler pods, whose member gateway serves the target port.
    scheduler = rendered.named("Deployment", "pagoda-scheduler")
    labels = scheduler["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    member = container(scheduler, "gateway")
    assert [p["containerPort"] for p in member["ports"]] == [spec["targetPorts"][0]["number"]]
    assert "--scheduler-addrs=127.0.0.1:50052" in member["args"]
    assert "--peer-metrics=scheduler=127.0.0.1:9090" in member["args"]
    # The route sends the Gateway's traffic to the pool.
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                    "kind": "InferencePool", "name": pool["metadata"]["name"]}]
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"


def admits(policy: dict, port: int, component: str | None) -> bool:
    """Whether `policy` lets pods of `component` (None: anyone, outside the cluster
    too) reach `port`."""
    for rule in policy["spec"]["ingress"]:
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        sources = rule.get("from")
        if sources is None:
            return True
        if component is not None and any(
                s.get("podSelector", {}).get("matchLabels", {}).get(
                    "app.kubernetes.io/component") == component for s in sources):
            return True
    return False


def test_network_policies_let_the_pool_traffic_through(chart):
    rendered = chart.template(values=(POOL_VALUES,))
    policy = {p["metadata"]["name"]: p for p in rendered.of_kind("NetworkPolicy")}
    assert admits(policy["pagoda-epp"], 9002, None)  # the Gateway's proxy, from anywhere
    assert admits(policy["pagoda-scheduler"], 8000, None)  # ... and the members
    assert admits(policy["pagoda-scheduler"], 50052, "epp")
    assert not admits(policy["pagoda-scheduler"], 50052, None)
    assert admits(policy["pagoda-tokenizer"], 50051, "epp")
    assert admits(policy["pagoda-tokenizer"], 50051, "scheduler")  # the member gateways
    assert admits(policy["pagoda-kv-cache-manager"], 50054, "epp")
    plain = {p["metadata"]["name"]: p for p in chart.template().of_kind("NetworkPolicy")}
    assert not admits(plain["pagoda-scheduler"], 8000, None)
    assert not admits(plain["pagoda-tokenizer"], 50051, "scheduler")


def test_pool_with_an_external_picker(chart):
    rendered = chart.template(values=(POOL_VALUES,), sets=EXTERNAL)
    pool, _ = pool_and_route(rendered)
    assert pool["spec"]["endpointPickerRef"] == {"kind": "Service", "name": "llm-d-epp",
                                                 "port": {"number": 9102},
                                                 "failureMode": "FailOpen"}
    assert not [d for d in rendered.docs if d["metadata"]["name"] == "pagoda-epp"]


def test_disaggregated_pool_is_the_decode_pods(chart):
    rendered = chart.template(values=(DISAGG_VALUES, POOL_VALUES))
    pool, _ = pool_and_route(rendered)
    assert pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "decode"
    member = container(rendered.named("Deployment", "pagoda-decode"), "gateway")
    addrs = next(a for a in member["args"] if a.startswith("--scheduler-addrs="))
    assert addrs.startswith("--scheduler-addrs=127.0.0.1:50052,dns:///pagoda-prefill-headless.")
    prefill = rendered.named("Deployment", "pagoda-prefill")
    assert "gateway" not in [c["name"] for c in prefill["spec"]["template"]["spec"]["containers"]]
    epp_args = container(rendered.named("Deployment", "pagoda-epp"), "epp")["args"]
    assert any(a.startswith("--scheduler-addrs=dns:///pagoda-decode-headless.") for a in epp_args)


def test_pool_off_renders_none_of_it(chart):
    rendered = chart.template()
    assert not rendered.of_kind("InferencePool") and not rendered.of_kind("HTTPRoute")
    assert not [d for d in rendered.docs if "epp" in d["metadata"]["name"]]


def test_the_schemas_catch_what_the_api_server_would_refuse():
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p"},
            "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}
    assert errors(POOL, pool) == []
    for broken in ({"failureMode": "Open"}, {"port": None}, {"name": ""}):
        ref = {**pool["spec"]["endpointPickerRef"], **broken}
        ref = {k: v for k, v in ref.items() if v is not None}
        assert errors(POOL, {**pool, "spec": {**pool["spec"], "endpointPickerRef": ref}})
    two_ports = {**pool["spec"], "targetPorts": [{"number": 1}, {"number": 2}]}
    assert errors(POOL, {**pool, "spec": two_ports})


@pytest.mark.parametrize("sets, message", [
    (("inferencePool.enabled=true",), "inferencePool.httpRoute.parentRefs"),
    (("inferencePool.enabled=true", "inferencePool.httpRoute.enabled=false",
      "inferencePool.targetPort=50052"), "inferencePool.targetPort"),
])
def test_bad_pool_values_fail_the_render(chart, sets, message):
    assert message in chart.template_error(sets=sets)
