"""The picker's choice with the gateway's real Router over stand-in replicas (no
processes): the subset hint narrows the candidates, GIE's saturation decides shedding
(sheddable only, every candidate saturated, unknown load counts as saturated), a LoRA
adapter named as the model goes where it is held, the load the choice reserves steers
the next one, and the fallbacks are the other candidates, least loaded first."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.epp.body import parse_body
from pagoda.services.epp.endpoints import EndpointResolver
from pagoda.services.epp.picker import Picker, PickError, SaturationThresholds
from pagoda.services.gateway.routing.router import Router


@dataclass
class Replica:
    address: str
    load: spb.GetLoadResponse | None = field(default_factory=spb.GetLoadResponse)
    routable: bool = True
    num_in_flight: int = 0
    num_pending_tokens: int = 0

    def __post_init__(self) -> None:
        self.info = spb.GetModelInfoResponse(model="base", block_size=16, max_cpu_loras=2,
                                             served_model_name=["tiny"],
                                             instance_id=self.address)

    @property
    def instance_id(self) -> str:
        return self.address

    def is_routable(self) -> bool:
        return self.routable

    def num_requests(self) -> int:
        reported = self.load.num_running + self.load.num_waiting if self.load else 0
        return max(self.num_in_flight, reported)


class Tokenizer:
    async def Tokenize(self, request, timeout=None):  # noqa: N802 (the stub's name)
        return tpb.TokenizeResponse(token_ids=list(range(len(request.prompt))))


class Peers:
    def __init__(self, replicas: list[Replica]) -> None:
        self.schedulers = replicas
        self.router = Router("kv_aware")
        self.tokenizer = type("T", (), {"stub": Tokenizer()})()

    def routing_block_size(self) -> int:
        return 0

    def model_info(self):
        return self.schedulers[0].info


def picker(*replicas: Replica, queue: int = 5) -> Picker:
    return Picker(Peers(list(replicas)), EndpointResolver(8000), SaturationThresholds(queue))


def pick(p: Picker, body: str = '{"prompt": "hello"}', subset=None, sheddable=False):
    return asyncio.run(p.pick(parse_body(body.encode()), subset, sheddable))


def test_subset_hint_and_no_candidates():
    a, b = Replica("10.0.0.1:50052"), Replica("10.0.0.2:50052")
    p = picker(a, b)
    assert pick(p, subset=["10.0.0.2:8000"]).endpoints == ["10.0.0.2:8000"]
    with pytest.raises(PickError) as info:
        pick(p, subset=["10.0.0.3:8000"])
    assert info.value.status == 503
    a.routable = b.routable = False
    with pytest.raises(PickError) as info:
        pick(p)
    assert info.value.status == 503


def test_shedding_follows_gie_saturation():
    busy = spb.GetLoadResponse(num_waiting=5)
    full = spb.GetLoadResponse(kv_cache_usage=0.9)
    a, b = Replica("10.0.0.1:50052", busy), Replica("10.0.0.2:50052", full)
    p = picker(a, b)
    with pytest.raises(PickError) as info:
        pick(p, sheddable=True)
    assert info.value.status == 429
    assert pick(p, sheddable=False).endpoint  # a critical request is still routed
    b.load = spb.GetLoadResponse()  # b has room again: the sheddable one goes there
    assert pick(p, sheddable=True).endpoint == "10.0.0.2:8000"
    b.load = None  # no fresh load: saturated, as GIE counts a stale pod
    with pytest.raises(PickError):
        pick(p, sheddable=True)


def test_reserved_load_spreads_a_burst_and_fallbacks_are_least_loaded():
    replicas = [Replica(f"10.0.0.{i}:50052") for i in (1, 2, 3)]
    p = picker(*replicas)
    picks = [pick(p, '{"prompt": "%s"}' % ("x" * i)) for i in (1, 2, 3)]
    assert sorted(x.endpoint for x in picks) == ["10.0.0.1:8000", "10.0.0.2:8000",
                                                 "10.0.0.3:8000"]
    for x in picks[1:]:
        x.route.release()
    fourth = pick(p)
    assert fourth.endpoint != picks[0].endpoint  # still holds the first request
    assert len(fourth.endpoints) == 3 and fourth.endpoints[-1] == picks[0].endpoint


def test_a_lora_adapter_goes_where_it_is_held():
    a = Replica("10.0.0.1:50052", spb.GetLoadResponse(num_running=3))
    b = Replica("10.0.0.2:50052", spb.GetLoadResponse(lora_adapters=["sql"]))
    c = Replica("10.0.0.3:50052", spb.GetLoadResponse(lora_adapters=["sql"], num_running=1))
    a.load.lora_adapters.extend(["x", "y"])  # a is full (max_cpu_loras 2)
    p = picker(a, b, c)
    chosen = pick(p, '{"model": "sql", "prompt": "q"}')
    assert chosen.endpoint == "10.0.0.2:8000"
    assert "10.0.0.1:8000" not in chosen.endpoints  # not a candidate for this adapter
    # The base model by any of its names is no adapter: every replica is a candidate.
    assert len(pick(p, '{"model": "tiny", "prompt": "q"}').endpoints) == 3
