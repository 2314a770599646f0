"""`--scheduler-addrs k8s://NAMESPACE/SERVICE:PORT`: replicas from the Service's
EndpointSlices, watched with the official kubernetes client.

No Kubernetes API server runs here: k8s_stand_in.py serves the two requests the client
makes (the EndpointSlice list and its watch stream) and the tests point the client at it
through $KUBECONFIG. The last test runs the real gateway process against it, with fake
schedulers on 127.0.0.2 and 127.0.0.3 (one port, like pod IPs behind one Service).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from gateway_harness import FakeScheduler
from grpc_servers import start_grpc_server
from k8s_stand_in import KubeAPIStandIn, endpoint
from serve_cluster import wait_until

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.free_ports import free_port
from pagoda.services.gateway.routing.discovery import Discovery, Target, parse_scheduler_addrs
from pagoda.services.gateway.routing.discovery_k8s import EndpointSliceWatch
from pagoda.services.tokenizer.servicer import TokenizerServicer

NS, SVC, PORT = "inference", "pagoda-scheduler-headless", 50052
A, B, C = "10.1.0.1", "10.1.0.2", "10.1.0.3"


def at(*ips: str) -> list[str]:
    return sorted(ips)


@pytest.fixture
def api(tmp_path, monkeypatch):
    """The stand-in API server, and $KUBECONFIG pointing at it (no in-cluster config
    here: KUBERNETES_SERVICE_HOST is unset)."""
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    stand_in = KubeAPIStandIn(NS)
    monkeypatch.setenv("KUBECONFIG", str(stand_in.kubeconfig(tmp_path)))
    yield stand_in
    stand_in.close()


@pytest.fixture
def watch(api):
    started: list[EndpointSliceWatch] = []

    def start(service: str = SVC) -> EndpointSliceWatch:
        started.append(EndpointSliceWatch(NS, service).start())
        return started[-1]

    yield start
    for w in started:
        w.stop()


def test_k8s_targets_parse_and_name_their_service():
    targets = parse_scheduler_addrs(f"k8s://{NS}/{SVC}:{PORT},static:1")
    assert targets == [Target(SVC, PORT, False, NS), Target("static", 1, False)]
    assert targets[0].dns_name == f"{SVC}.{NS}.svc"
    for bad in ("k8s://svc:1", f"k8s://{NS}/{SVC}", f"k8s://{NS}/a/b:1", "k8s:///svc:1"):
        with pytest.raises(ValueError):
            parse_scheduler_addrs(bad)


def test_only_endpoints_whose_conditions_say_serving_are_replicas(api, watch):
    api.set_slice("s-1", SVC, [endpoint(A), endpoint(B, ready=False),
                               endpoint(C, ready=False, serving=True, terminating=True)], PORT)
    api.set_slice("other", "another-service", [endpoint("10.9.9.9")], PORT)
    w = watch()
    assert wait_until(lambda: w.addresses() == at(A), 20), w.addresses()
    api.set_slice("s-1", SVC, [endpoint(A), endpoint(B)], PORT)  # B turned Ready
    assert wait_until(lambda: w.addresses() == at(A, B), 10), w.addresses()
    # Pod A is being deleted: terminating at once, still serving until its process stops.
    api.set_slice("s-1", SVC, [endpoint(A, ready=False, serving=True, terminating=True),
                               endpoint(B)], PORT)
    assert wait_until(lambda: w.addresses() == at(B), 10), w.addresses()
    api.set_slice("s-2", SVC, [endpoint(C)], PORT)  # a second slice of the same Service
    assert wait_until(lambda: w.addresses() == at(B, C), 10), w.addresses()
    api.delete_slice("s-1")
    assert wait_until(lambda: w.addresses() == at(C), 10), w.addresses()


def test_a_dropped_or_expired_watch_lists_again_and_keeps_what_it_knew(api, watch):
    api.set_slice("s-1", SVC, [endpoint(A)], PORT)
    w = watch()
    assert wait_until(lambda: w.addresses() == at(A) and api.num_watches == 1, 20)
    # Changes while the connection is down reach the client through its next list.
    api.set_slice("s-1", SVC, [endpoint(B)], PORT, notify=False)
    api.drop_watches()
    assert wait_until(lambda: w.addresses() == at(B), 10), w.addresses()
    assert api.num_lists >= 2
    assert wait_until(lambda: api.num_watches >= 2, 10)
    lists = api.num_lists
    api.set_slice("s-1", SVC, [endpoint(C)], PORT, notify=False)
    api.expire_watches()  # 410 Gone: the watch's resourceVersion is too old
    assert wait_until(lambda: w.addresses() == at(C), 10), w.addresses()
    assert api.num_lists > lists
    api.close()  # the API server goes away altogether: the last answer stands
    time.sleep(0.5)
    assert w.addresses() == at(C)


def test_without_the_api_the_service_dns_name_stands_in(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    dead = KubeAPIStandIn(NS)
    monkeypatch.setenv("KUBECONFIG", str(dead.kubeconfig(tmp_path)))
    dead.close()  # nothing listens there any more
    asked: list[tuple[str, int]] = []

    async def resolver(host, port):
        asked.append((host, port))
        return [(None, None, None, "", ("10.2.0.1", port))]

    async def run() -> list[str]:
        discovery = Discovery(parse_scheduler_addrs(f"k8s://{NS}/{SVC}:{PORT}"), resolver, 5.0)
        try:
            deadline = time.monotonic() + 20
            while not (found := await discovery.addresses(time.monotonic())):
                assert time.monotonic() < deadline, "never fell back to DNS"
                await discovery.wait_changed(0.2)
            return found
        finally:
            discovery.close()

    assert asyncio.run(run()) == ["10.2.0.1:50052"]
    assert asked[0] == (f"{SVC}.{NS}.svc", PORT)


def test_discovery_wakes_its_caller_when_the_endpoints_change(api):
    api.set_slice("s-1", SVC, [endpoint(A)], PORT)

    async def run():
        discovery = Discovery(parse_scheduler_addrs(f"k8s://{NS}/{SVC}:{PORT}"))
        try:
            # The first call starts the watch; its first list may land before the call
            # returns (a quiet machine) or after it (then it wakes the caller).
            first = await discovery.addresses(time.monotonic())
            if not first:
                await discovery.wait_changed(30)
            listed = await discovery.addresses(time.monotonic())
            api.set_slice("s-1", SVC, [endpoint(A), endpoint(B)], PORT)
            start = time.monotonic()
            await discovery.wait_changed(30)
            woke_early = time.monotonic() - start < 30
            return first, listed, await discovery.addresses(time.monotonic()), woke_early
        finally:
            discovery.close()

    first, listed, after, woke_early = asyncio.run(run())
    assert first in ([], [f"{A}:{PORT}"]) and listed == [f"{A}:{PORT}"] and woke_early
    assert after == [f"{A}:{PORT}", f"{B}:{PORT}"]


# ------------------------------------------------------------------ the gateway process
class NamedScheduler(FakeScheduler):
    """The scripted fake scheduler, reporting its own instance id."""

    def __init__(self, tokenizer, instance_id: str) -> None:
        super().__init__(tokenizer)
        self.instance_id = instance_id

    def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model="/models/fake", max_model_len=256, block_size=16,
                                        served_model_name=["fake-model"],
                                        instance_id=self.instance_id)

    def GetLoad(self, request, context):
        return spb.GetLoadResponse(serving=True)


def _serve_at(ip: str, port: int, servicer) -> grpc.Server:
    return start_grpc_server(spb_grpc.add_SchedulerServiceServicer_to_server, servicer,
                             f"{ip}:{port}")[0]


def test_the_gateway_routes_by_the_watched_endpoints(api, tmp_path, smollm2_tokenizer,
                                                     grpc_server_factory):
    tokenizer = grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                    TokenizerServicer(smollm2_tokenizer, "smollm2", [2]))
    port = free_port()
    ips = {"a": "127.0.0.2", "b": "127.0.0.3"}
    servers = [_serve_at(ip, port, NamedScheduler(smollm2_tokenizer, name))
               for name, ip in ips.items()]
    api.set_slice("s-1", SVC, [endpoint(ips["a"])], port)
    http_port = free_port()
    base = f"http://127.0.0.1:{http_port}"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "pagoda.services.cli.main", "gateway", "--port", str(http_port),
         "--tokenizer-addr", tokenizer.address, "--scheduler-addrs", f"k8s://{NS}/{SVC}:{port}",
         "--router", "round_robin", "--kv-cache-manager-addr", ""],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def healthy() -> bool:
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def served_by() -> str:
        reply = httpx.post(f"{base}/v1/completions", timeout=30, json={
            "model": "fake-model", "prompt": "Hello", "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        return reply.headers["x-pagoda-instance"]

    def only(name: str, n: int = 8) -> bool:
        """The next `n` requests all went to `name` (round robin alternates otherwise)."""
        return all(served_by() == name for _ in range(n))

    try:
        assert wait_until(healthy, 60), "the gateway never found the ready endpoint"
        assert only("a")
        api.set_slice("s-1", SVC, [endpoint(ips["a"]), endpoint(ips["b"])], port)
        assert wait_until(lambda: served_by() == "b", 15), "a new Ready pod got no request"
        assert {served_by() for _ in range(4)} == {"a", "b"}

        # Pod a is marked for deletion: terminating, still serving its last streams.
        api.set_slice("s-1", SVC, [endpoint(ips["a"], ready=False, serving=True,
                                            terminating=True), endpoint(ips["b"])], port)
        assert wait_until(lambda: only("b", 4), 15)
        assert only("b")

        # The watch breaks; meanwhile a is back and b goes: the next list shows both.
        api.set_slice("s-1", SVC, [endpoint(ips["a"]),
                                   endpoint(ips["b"], ready=False, terminating=True)], port,
                      notify=False)
        api.drop_watches()
        assert wait_until(lambda: only("a", 4), 15)
        assert only("a")

        api.delete_slice("s-1")  # the Service has no endpoints left
        assert wait_until(lambda: not healthy(), 15)
    finally:
        gateway.send_signal(signal.SIGTERM)
        try:
            code = gateway.wait(30)
        finally:
            if gateway.poll() is None:
                gateway.kill()
            for server in servers:
                server.stop(None)
    log = gateway.stderr.read()
    assert code == 0 and "Traceback" not in log, log[-3000:]
    assert f"k8s://{NS}/{SVC} serves at 127.0.0.2" in log
