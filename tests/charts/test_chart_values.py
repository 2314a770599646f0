"""values.schema.json is generated from values.yaml, rejects wrong types and unknown keys at
every level, and the chart refuses value combinations that would disagree."""

from __future__ import annotations

import json

import jsonschema
import pytest

from chart_harness import CHART, CI_VALUES, gen_values_schema, merged_values

SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def test_schema_is_generated_from_values_yaml():
    assert gen_values_schema.render() == (CHART / "values.schema.json").read_text(), (
        "run: python tools/gen_values_schema.py")


def _objects(schema: dict, path: str = ""):
    """Every object schema inside `schema`, with a readable path."""
    if schema.get("type") == "object":
        yield path or "<root>", schema
    for key in ("properties", "$defs"):
        for name, sub in schema.get(key, {}).items():
            yield from _objects(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from _objects(schema[key], f"{path}[]")
    for sub in schema.get("anyOf", []):
        yield from _objects(sub, path)


def test_every_object_is_closed_or_a_typed_map():
    for path, obj in _objects(SCHEMA):
        extra = obj.get("additionalProperties")
        if "properties" in obj:
            assert extra is False, f"{path} accepts unknown keys"
        else:  # a map (labels, resources): its values still have a type
            assert isinstance(extra, dict) and extra, f"{path} is an untyped map"


@pytest.mark.parametrize("values", [CHART / "values.yaml", *CI_VALUES], ids=lambda p: p.stem)
def test_shipped_values_satisfy_the_schema(values):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    jsonschema.Draft202012Validator(SCHEMA).validate(merged_values(values))


@pytest.mark.parametrize(("setting", "message"), [
    ("global.blockSize=sixteen", "/global/blockSize"),
    ("gateway.replicas=two", "/gateway/replicas"),
    ("scheduler.enablePrefixCaching=maybe", "/scheduler/enablePrefixCaching"),
    ("global.device=tpu", "/global/device"),
    ("global.tensorParallelSize=0", "/global/tensorParallelSize"),
    ("gpuWorker.gpuMemoryUtilization=1.5", "/gpuWorker/gpuMemoryUtilization"),
    ("gateway.port=70000", "/gateway/port"),
    ("tokenizer.pdb.maxUnavailable=0", "/tokenizer/pdb/maxUnavailable"),
    ("gateway.resources.requests.cpu=lots", "/gateway/resources/requests/cpu"),
], ids=lambda v: v.split("=")[0] if "=" in v else "")
def test_helm_rejects_wrong_types(chart, setting, message):
    assert message in chart.template_error(sets=(setting,))


@pytest.mark.parametrize(("setting", "where"), [
    ("replicaCount=2", "additional properties 'replicaCount' not allowed"),
    ("gateway.bogus=1", "/gateway"),
    ("gpuWorker.replicas=2", "/gpuWorker"),  # engine pods scale through scheduler.replicas
    ("global.image.digest=sha256:x", "/global/image"),
    ("scheduler.drain.timeout=5", "/scheduler/drain"),
    ("gateway.probes.initialDelaySeconds=5", "/gateway/probes"),
    ("gateway.extraEnv[0].name=A", "/gateway/extraEnv/0"),  # value is required
], ids=lambda v: v.split("=")[0] if "=" in v else "")
def test_helm_rejects_unknown_or_missing_keys(chart, setting, where):
    error = chart.template_error(sets=(setting,))
    assert where in error, error


def test_helm_rejects_unknown_key_in_a_values_file(chart, tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("scheduler:\n  maxNumSeq: 128\n")  # maxNumSeqs misspelt
    assert "maxNumSeq" in chart.template_error(values=(bad,))


@pytest.mark.parametrize(("settings", "message"), [
    (("redis.externalUrl=redis://r:6379/0",), "redis.enabled=false"),
    (("redis.enabled=false",), "set redis.externalUrl or redis.externalUrlSecret.name"),
    (("redis.enabled=false", "redis.externalUrl=redis://r:6379/0",
      "redis.externalUrlSecret.name=s"), "only one of"),
    (("gateway.apiKey.value=a", "gateway.apiKey.existingSecret=b"), "only one of value"),
    (("scheduler.drain.timeoutSeconds=60",), "terminationGracePeriodSeconds"),
    (("gateway.preStopSleepSeconds=90",), "gateway.terminationGracePeriodSeconds"),
    (("gateway.preStopSleepSeconds=55",), "--shutdown-grace-period"),
    (("scheduler.autoscaling.enabled=true", "scheduler.keda.enabled=true"), "not both"),
    (("scheduler.autoscaling.enabled=true", "scheduler.autoscaling.targetCPUUtilizationPercentage=0"),
     "targetNumRequestsWaiting"),
    (("gateway.autoscaling.enabled=true", "gateway.autoscaling.minReplicas=5"),
     "minReplicas exceeds maxReplicas"),
    (("tokenizer.autoscaling.enabled=true", "tokenizer.resources.requests=null"),
     "tokenizer.resources.requests.cpu"),
    (("gpuWorker.metricsPort=9090",), "must differ"),
    (("gpuWorker.resources.limits.nvidia\\.com/gpu=1",), "do not set nvidia.com/gpu"),
])
def test_chart_refuses_values_that_disagree(chart, settings, message):
    error = chart.template_error(sets=settings)
    assert message in error, error
