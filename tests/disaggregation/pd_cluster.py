"""Disaggregated clusters for the tests in tests/disaggregation: `pagoda serve --prefill-replicas 1
--decode-replicas 1` on the module's Redis. The colocated cluster they compare against is the
session's `plain_tiny_cluster` (tests/shared_clusters.py), started with the same BASE flags."""

from __future__ import annotations

import grpc
import httpx
import psutil
from serve_cluster import CLI_MODULE, ServeProcess, flag_value, scheduler_load, wait_until
from shared_clusters import PLAIN_TINY_FLAGS

from pagoda.messages import EngineCoreOutput, EngineCoreRequest
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services.common.protocol.scheduler import request_to_proto, response_to_output

PREFILL_HEADER = "x-pagoda-prefill-instance"

# The colocated cluster's flags: greedy outputs compare equal only under the same ones.
BASE = PLAIN_TINY_FLAGS


def start_pd(model_dir: str, redis_url: str, *extra: str,
             env: dict[str, str] | None = None) -> ServeProcess:
    """The cluster, checked to route prefills to the prefill replica: `pagoda serve` is up
    once its gateway's /health is 200, which in a P/D cluster waits for a checked prefill/
    decode pair (test_pd_readiness.py), so the first check passes."""
    serve = ServeProcess([model_dir, *BASE, "--redis-url", redis_url, "--prefill-replicas",
                          "1", "--decode-replicas", "1", *extra], env=env)

    def prefilled_remotely() -> bool:
        # A prompt shorter than a block: the prefill replica leases nothing, the request
        # ends with its one token, and no transfer is tried or counted.
        reply = httpx.post(f"{serve.base}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hi", "max_tokens": 1})
        return PREFILL_HEADER in reply.headers

    if not wait_until(prefilled_remotely, 60, interval=0.5):
        serve.stop()
        raise RuntimeError("the gateway never routed a prefill to the prefill replica")
    return serve


def role_processes(serve: ServeProcess, kind: str, role: str) -> list[psutil.Process]:
    """The `kind` processes (scheduler, gpu-worker) whose --kv-transfer-config has `role`."""
    found = []
    for child in psutil.Process(serve.process.pid).children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if CLI_MODULE in cmd and cmd[cmd.index(CLI_MODULE) + 1] == kind \
                and "--kv-transfer-config" in cmd \
                and f'"kv_role":"{role}"' in flag_value(cmd, "--kv-transfer-config"):
            found.append(child)
    return found


def role_process(serve: ServeProcess, kind: str, role: str) -> psutil.Process:
    """The (first) `kind` process whose --kv-transfer-config has `role`."""
    found = role_processes(serve, kind, role)
    if not found:
        raise LookupError(f"{kind} {role}")
    return found[0]


def role_address(serve: ServeProcess, kind: str, role: str) -> str:
    return f"127.0.0.1:{flag_value(role_process(serve, kind, role).cmdline(), '--port')}"


def metric(serve: ServeProcess, name: str, **labels) -> float:
    """A sample of the cluster's /metrics (the gateway merges its peers'), summed over
    the series whose labels include `labels`."""
    return sum(v for (n, ls), v in serve.scrape().items()
               if n == name and all((k, val) in ls for k, val in labels.items()))


def usage(address: str) -> float:
    """A scheduler's KV cache usage (0: every block free or only cached)."""
    return scheduler_load(address).kv_cache_usage


def lease_records(store) -> dict[str, dict]:
    """Every lease record in Redis: lease id -> its fields."""
    return {key.decode().rsplit(":", 1)[1]: {k.decode(): v.decode()
                                             for k, v in store.hgetall(key).items()}
            for key in store.keys("pagoda:kv:*:lease:*")}


def generate(address: str, request: EngineCoreRequest) -> list[EngineCoreOutput]:
    """One request sent straight to a scheduler (as the gateway would): its outputs."""
    with grpc.insecure_channel(address) as channel:
        stream = spb_grpc.SchedulerServiceStub(channel).Generate(request_to_proto(request),
                                                                 timeout=60)
        return [response_to_output(request.request_id, message) for message in stream]
