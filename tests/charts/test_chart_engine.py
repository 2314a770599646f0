"""Values set once reach every component that needs them, and the engine pod (scheduler +
gpu-worker) gets the GPUs, Ray flag and drain timings its values imply."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys
import time

import pytest

from chart_harness import CI_VALUES, merged_values
from chart_manifests import engine_pods, flags, pods

MODEL_USERS = ("tokenizer", "scheduler", "gpu-worker")


def _engine(rendered):
    (engine,) = [p for p in pods(rendered) if p.deployment == "pagoda-scheduler"]
    return engine


ENGINE_FLAGS = {"model", "device", "dtype", "block-size", "max-num-seqs",
                "max-num-batched-tokens", "gpu-memory-utilization", "tensor-parallel-size",
                "pipeline-parallel-size"}
OPTIONAL_ENGINE_FLAGS = {"max-model-len", "num-gpu-blocks-override", "enable-prefix-caching",
                         "no-enable-prefix-caching"}


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_model_block_size_and_parallelism_set_once(chart, values):
    rendered = chart.template(values=(values,))
    v = merged_values(values)
    g = v["global"]
    containers = [c for p in pods(rendered) for c in p.containers]
    models = {flags(c)["model"] for c in containers if c.get("args", [None])[0] in MODEL_USERS}
    assert models == {g["model"]}
    engines = engine_pods(rendered)
    assert len(engines) == (2 if v["disaggregation"]["enabled"] else 1)
    assert sum(c.get("args", [None])[0] in MODEL_USERS for c in containers) == \
        1 + 2 * len(engines)

    for engine in engines:
        s, w = flags(engine.container("scheduler")), flags(engine.container("gpu-worker"))
        assert ENGINE_FLAGS <= set(s)
        shared = (set(s) | set(w)) & (ENGINE_FLAGS | OPTIONAL_ENGINE_FLAGS)
        assert {k: s.get(k) for k in shared} == {k: w.get(k) for k in shared}
        assert (s["block-size"], s["device"]) == (str(g["blockSize"]), g["device"])
        assert s["tensor-parallel-size"] == str(g["tensorParallelSize"])
        assert s["dtype"] == v["gpuWorker"]["dtype"]
        if engine.deployment == "pagoda-scheduler":
            assert s["max-num-seqs"] == str(v["scheduler"]["maxNumSeqs"])
        if g["servedModelName"]:
            (gateway,) = [p for p in pods(rendered) if p.deployment == "pagoda-gateway"]
            assert flags(gateway.container("gateway"))["served-model-name"] == \
                g["servedModelName"]
            assert s["served-model-name"] == g["servedModelName"]


def test_prefix_caching_off_is_said_explicitly(chart):
    """The engine's own default is on: omitting the flag would silently keep it on."""
    engine = _engine(chart.template(sets=("scheduler.enablePrefixCaching=false",)))
    for name in ("scheduler", "gpu-worker"):
        f = flags(engine.container(name))
        assert "no-enable-prefix-caching" in f and "enable-prefix-caching" not in f


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_each_replica_has_its_own_instance_id(chart, values):
    for engine in engine_pods(chart.template(values=(values,))):
        scheduler = engine.container("scheduler")
        assert flags(scheduler)["instance-id"] == "$(POD_NAME)"
        env = {e["name"]: e for e in scheduler["env"]}
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_gpus_and_ray_follow_device_and_group_size(chart, values):
    g = merged_values(values)["global"]
    ranks = g["tensorParallelSize"] * g["pipelineParallelSize"]
    for engine in engine_pods(chart.template(values=(values,))):
        worker = engine.container("gpu-worker")
        gpus = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert gpus == (ranks if g["device"] == "cuda" else None)
        assert engine.container("scheduler")["resources"].get("limits", {}).get(
            "nvidia.com/gpu") is None
        backend = flags(worker).get("distributed-executor-backend")
        assert backend == ("ray" if ranks > 1 else None)
        assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]


def test_pipeline_parallel_multiplies_gpus(chart):
    rendered = chart.template(sets=("global.device=cuda", "global.tensorParallelSize=2",
                                    "global.pipelineParallelSize=2"))
    worker = _engine(rendered).container("gpu-worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert flags(worker)["distributed-executor-backend"] == "ray"
    assert rendered.named("Deployment", "pagoda-scheduler")["spec"]["template"]["spec"][
        "containers"][0]["image"].endswith("-cuda")


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_drain_fits_in_the_grace_period(chart, values):
    s = merged_values(values)["scheduler"]
    for engine in engine_pods(chart.template(values=(values,))):
        scheduler = engine.container("scheduler")
        assert flags(scheduler)["drain-timeout"] == str(s["drain"]["timeoutSeconds"])
        sleep = scheduler["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert sleep == s["drain"]["preStopSleepSeconds"]
        grace = engine.spec["terminationGracePeriodSeconds"]
        assert grace >= sleep + s["drain"]["timeoutSeconds"]
        # The worker outlives its scheduler's drain: its preStop waits for the scheduler.
        hook = engine.container("gpu-worker")["lifecycle"]["preStop"]["exec"]["command"]
        assert str(s["metricsPort"]) in hook[-1]


def test_worker_prestop_waits_for_the_scheduler_then_returns(chart):
    """Run the worker's preStop script: it must return once nothing listens on the
    scheduler's metrics port, and keep waiting while something does."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        rendered = chart.template(sets=(f"scheduler.metricsPort={port}",
                                        "scheduler.drain.timeoutSeconds=3",
                                        "scheduler.drain.preStopSleepSeconds=0"))
        hook = _engine(rendered).container("gpu-worker")["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[:2] == ["python", "-c"]
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", hook[2]], check=True, timeout=30)
        waited = time.monotonic() - start
    assert waited >= 2.5  # bounded by the drain budget while the scheduler is alive
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", hook[2]], check=True, timeout=30)
    assert time.monotonic() - start < 2  # the scheduler has exited: return at once


def test_api_key_reaches_the_gateway_from_a_secret(chart):
    rendered = chart.template(sets=("gateway.apiKey.value=s3cret",))
    secret = rendered.named("Secret", "pagoda-gateway-api-key")
    assert base64.b64decode(secret["data"]["api-key"]) == b"s3cret"
    (gateway,) = [p for p in pods(rendered) if p.deployment == "pagoda-gateway"]
    env = {e["name"]: e for e in gateway.container("gateway")["env"]}
    assert env["PAGODA_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "pagoda-gateway-api-key", "key": "api-key"}
    assert "s3cret" not in str(gateway.container("gateway")["args"])

    rendered = chart.template(sets=("gateway.apiKey.existingSecret=mine",))
    assert "pagoda-gateway-api-key" not in {s["metadata"]["name"] for s in rendered.of_kind("Secret")}
    (gateway,) = [p for p in pods(rendered) if p.deployment == "pagoda-gateway"]
    env = {e["name"]: e for e in gateway.container("gateway")["env"]}
    assert env["PAGODA_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "mine"


def test_plain_external_redis_url_is_passed_through(chart):
    url = "redis://redis.data.svc:6379/2"
    rendered = chart.template(sets=("redis.enabled=false", f"redis.externalUrl={url}",
                                    "redis.auth.existingSecret=redis-auth"))
    (manager,) = [p for p in pods(rendered) if p.deployment == "pagoda-kv-cache-manager"]
    assert flags(manager.container("kv-cache-manager"))["redis-url"] == url
    env = {e["name"]: e for e in manager.container("kv-cache-manager")["env"]}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-auth", "key": "redis-password"}
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in rendered.docs}
    assert "redis" not in components  # the chart's own Redis is off
