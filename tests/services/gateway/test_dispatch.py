"""The gateway end to end over scripted replicas: retries on refusal, the instance
header, session stickiness."""

from __future__ import annotations

import grpc
import httpx
import pytest
from app_server import AppServer

from pagoda.services._proto.pagoda.common.v1 import common_pb2 as cpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.gateway.app import create_app
from pagoda.services.tokenizer.servicer import TokenizerServicer

BODY = {"model": "m", "prompt": "Hello there", "max_tokens": 3}


class ScriptedReplica(spb_grpc.SchedulerServiceServicer):
    """Answers three tokens, or refuses every request with `refuse` (a status code)."""

    def __init__(self, name: str, refuse: grpc.StatusCode | None = None) -> None:
        self.name = name
        self.refuse = refuse
        self.num_refused = 0
        self.num_served = 0

    def Generate(self, request, context):
        if self.refuse is not None:
            self.num_refused += 1
            context.abort(self.refuse, "replica is draining" if self.refuse ==
                          grpc.StatusCode.UNAVAILABLE else "queue is full")
        self.num_served += 1
        yield spb.GenerateResponse(chunk=spb.GenerateChunk(token_ids=[504, 505, 506]))
        yield spb.GenerateResponse(complete=spb.GenerateComplete(
            finish_reason=cpb.FINISH_REASON_LENGTH))

    def GetModelInfo(self, request, context):
        return spb.GetModelInfoResponse(model="m", max_model_len=256, block_size=16,
                                        instance_id=self.name, served_model_name=["m"])

    def GetLoad(self, request, context):
        return spb.GetLoadResponse(serving=self.refuse is None)


@pytest.fixture
def gateway(grpc_server_factory, smollm2_tokenizer):
    """start(replicas, router) -> base URL of a gateway over them (stopped after the test)."""
    servers = []

    def start(replicas: list[ScriptedReplica], router: str = "kv_aware") -> str:
        tokenizer = grpc_server_factory(tpb_grpc.add_TokenizerServiceServicer_to_server,
                                        TokenizerServicer(smollm2_tokenizer, "m", [2]))
        addresses = [grpc_server_factory(spb_grpc.add_SchedulerServiceServicer_to_server,
                                         r).address for r in replicas]
        servers.append(AppServer(create_app(tokenizer.address, addresses, router=router)))
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


def test_a_draining_replica_refuses_and_the_request_lands_elsewhere(gateway):
    draining, serving = ScriptedReplica("a", grpc.StatusCode.UNAVAILABLE), ScriptedReplica("b")
    url = gateway([draining, serving], router="round_robin")  # round robin tries both
    for i in range(6):
        stream = i % 2 == 1
        reply = httpx.post(f"{url}/v1/completions", json={**BODY, "stream": stream}, timeout=30)
        assert reply.status_code == 200 and "error" not in reply.text
        assert reply.headers["x-pagoda-instance"] == "b"
    assert draining.num_refused >= 1 and serving.num_served == 6


def test_when_every_replica_refuses_the_client_gets_their_reason(gateway):
    full = [ScriptedReplica("a", grpc.StatusCode.RESOURCE_EXHAUSTED),
            ScriptedReplica("b", grpc.StatusCode.RESOURCE_EXHAUSTED)]
    url = gateway(full)
    reply = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30)
    assert reply.status_code == 503 and "queue is full" in reply.json()["error"]["message"]
    assert reply.headers.get("retry-after") and sum(r.num_refused for r in full) == 2


def test_a_session_sticks_to_one_replica(gateway):
    replicas = [ScriptedReplica(name) for name in "abc"]
    url = gateway(replicas, router="session")
    seen = {}
    for session in ("alice", "bob", "carol", "dave"):
        for _ in range(3):
            reply = httpx.post(f"{url}/v1/completions", json=BODY, timeout=30,
                               headers={"X-Session-Id": session})
            assert reply.status_code == 200
            seen.setdefault(session, set()).add(reply.headers["x-pagoda-instance"])
    assert all(len(instances) == 1 for instances in seen.values())
    # The body's `user` is a session key too (the header wins when both are sent).
    by_user = {httpx.post(f"{url}/v1/completions", json={**BODY, "user": "alice"},
                          timeout=30).headers["x-pagoda-instance"] for _ in range(3)}
    assert by_user == seen["alice"]
