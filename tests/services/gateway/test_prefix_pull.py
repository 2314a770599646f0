"""--kv-prefix-pull at the gateway: which replica a routed request pulls from (the one
the index says holds the most leading blocks, at least min_blocks more than the target,
able to lease and agreeing on the KV layout; never to a kv_producer), and what the
routed replica is sent (the lease's params once, or the request unchanged when the
lease fails, with the lease released when the choice ends)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
import pytest

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services.gateway.disagg import prefix_pull
from pagoda.services.gateway.disagg.prefix_pull import (PrefixPull, PrefixPullOptions,
                                                        PrefixPullReplica, choose_source)
from pagoda.services.gateway.observability.metrics import gateway_metrics
from pagoda.services.gateway.routing.router import PrefixLookup, Route, RouteRequest

BS = 16
PROMPT = list(range(1000, 1000 + 10 * BS + 3))  # 10 full blocks, all usable
HASHES = [bytes([i]) * 8 for i in range(10)]


@dataclass
class Replica:
    address: str
    kv_role: str = "kv_both"
    kv_dtype: str = "float32"
    serving: bool = True
    removed: bool = False
    hashes_agree: bool | None = True
    num_in_flight: int = 0
    num_pending_tokens: int = 0
    sent: list[EngineCoreRequest] = field(default_factory=list)

    @property
    def instance_id(self) -> str:
        return self.address

    @property
    def info(self) -> spb.GetModelInfoResponse:
        info = spb.GetModelInfoResponse(model="m", block_size=BS, instance_id=self.address,
                                        epoch=f"{self.address}-epoch", kv_role=self.kv_role)
        info.kv_layout.CopyFrom(kpb.KvLayout(model="m", kv_dtype=self.kv_dtype, block_size=BS,
                                             layout="blocks_tokens_heads_dim"))
        return info

    async def generate(self, request):
        self.sent.append(request)
        yield EngineCoreOutput(request.request_id, [7], finish_reason=FinishReason.LENGTH)


def route(target: Replica, cached: dict[str, int]) -> Route:
    return Route(target, "round_robin", prefix=PrefixLookup(HASHES, cached))


def test_the_most_blocks_from_a_replica_that_can_lease():
    r, s, t = Replica("r"), Replica("s"), Replica("t", kv_role="kv_producer")
    choice = choose_source([r, s, t], route(r, {"r": 2, "s": 7, "t": 9}), len(PROMPT), 4)
    assert (choice.source, choice.num_blocks, choice.num_held) == (t, 9, 2)
    # The prompt's last token is always computed: a block holding it is never pulled.
    short = PROMPT[:8 * BS]
    assert choose_source([r, s], route(r, {"s": 10}), len(short), 4).num_blocks == 7


@pytest.mark.parametrize("source, cached, min_blocks", [
    (Replica("s"), {"r": 4, "s": 7}, 4),                     # only 3 more than held
    (Replica("s", kv_role="kv_consumer"), {"s": 9}, 1),       # no lease service
    (Replica("s", serving=False), {"s": 9}, 1),
    (Replica("s", removed=True), {"s": 9}, 1),
    (Replica("s", hashes_agree=None), {"s": 9}, 1),
    (Replica("s", kv_dtype="bfloat16"), {"s": 9}, 1),        # the handshake fails
])
def test_no_pull(source, cached, min_blocks):
    r = Replica("r")
    assert choose_source([r, source], route(r, cached), len(PROMPT), min_blocks) is None


def test_the_target_s_own_tier_run_counts_at_its_weight():
    """R holds the prompt's first 9 blocks in its host tier: an onload there is worth
    0.8 of a device hit (7.2 blocks, so 8 held), a pull from S's 9 device blocks is only
    one block better. From its disk tier (0.5: 5 held) the pull is 4 better."""
    r, s = Replica("r"), Replica("s")
    in_host = Route(r, "kv_aware", prefix=PrefixLookup(HASHES, {"s": 9}, {"r": (9, 0)}))
    assert choose_source([r, s], in_host, len(PROMPT), 2) is None
    choice = choose_source([r, s], in_host, len(PROMPT), 1)
    assert (choice.source, choice.num_blocks, choice.num_held) == (s, 9, 8)
    on_disk = Route(r, "kv_aware", prefix=PrefixLookup(HASHES, {"s": 9}, {"r": (0, 9)}))
    assert choose_source([r, s], on_disk, len(PROMPT), 4).num_held == 5
    assert choose_source([r, s], on_disk, len(PROMPT), 4, {"CPU": 0.8, "DISK": 1.0}) is None


def test_a_source_s_tier_run_counts_below_its_device_run():
    """S holds 2 blocks on its device and the next 7 in its host tier (worth 2 + 5.6);
    T holds 7 on its device: S's run is the better pull, asked of its tier
    (num_device 2). With the disk's weight S's (2 + 3.5) loses to T's 7; a LoRA request
    (from_tiers False) sees only S's 2 device blocks."""
    r, s, t = Replica("r"), Replica("s"), Replica("t")
    host = Route(r, "kv_aware", prefix=PrefixLookup(HASHES, {"s": 2, "t": 7}, {"s": (7, 0)}))
    choice = choose_source([r, s, t], host, len(PROMPT), 4)
    assert (choice.source, choice.num_blocks, choice.num_device) == (s, 9, 2)
    assert choice.from_tier
    disk = Route(r, "kv_aware", prefix=PrefixLookup(HASHES, {"s": 2, "t": 7}, {"s": (0, 7)}))
    choice = choose_source([r, s, t], disk, len(PROMPT), 4)
    assert (choice.source, choice.num_blocks, choice.from_tier) == (t, 7, False)
    alone = Route(r, "kv_aware", prefix=PrefixLookup(HASHES, {"s": 2}, {"s": (7, 0)}))
    assert choose_source([r, s], alone, len(PROMPT), 4, from_tiers=False) is None
    # Only in a tier, 5 blocks (worth 4): a pull at min_blocks 4, not at 5.
    only = Route(r, "kv_aware", prefix=PrefixLookup(HASHES, {}, {"s": (5, 0)}))
    assert choose_source([r, s], only, len(PROMPT), 4).num_blocks == 5
    assert choose_source([r, s], only, len(PROMPT), 5) is None


def test_never_into_a_producer_nor_without_the_index():
    p, s = Replica("p", kv_role="kv_producer"), Replica("s")
    assert choose_source([p, s], route(p, {"s": 9}), len(PROMPT), 1) is None
    assert choose_source([p, s], Route(s, "kv_aware"), len(PROMPT), 1) is None


class LeaseStub:
    def __init__(self, answer) -> None:
        self.answer = answer
        self.asked: list[kpb.LeasePrefixRequest] = []
        self.timeouts: list[float] = []
        self.released: list[str] = []

    async def LeasePrefix(self, request, timeout):
        self.asked.append(request)
        self.timeouts.append(timeout)
        if isinstance(self.answer, grpc.StatusCode):
            raise grpc.aio.AioRpcError(self.answer, None, None, "gone")
        return self.answer

    async def ReleaseLease(self, request, timeout):
        self.released.append(request.lease_id)
        return kpb.ReleaseLeaseResponse(valid=True)


def pulled(answer, requests: list[EngineCoreRequest], tiers=None,
           lora=None) -> tuple[Replica, LeaseStub]:
    """Send `requests` through the wrapped target, with the source answering `answer`
    (`tiers`: the index's tier runs)."""
    r, s = Replica("r"), Replica("s")
    stub = LeaseStub(answer)

    class Peers:
        schedulers = [r, s]

    pull = PrefixPull(Peers(), PrefixPullOptions(True, 4))
    pull._stub = lambda replica: stub

    async def run() -> None:
        routed = Route(r, "round_robin", prefix=PrefixLookup(HASHES, {"r": 1, "s": 8},
                                                              tiers or {}))
        wrapped = pull.wrap(routed, RouteRequest(PROMPT, len(PROMPT), lora_request=lora))
        assert isinstance(wrapped, PrefixPullReplica)
        for request in requests:
            async for _ in wrapped.generate(request):
                pass
        await asyncio.sleep(0.01)  # the release task

    asyncio.run(run())
    return r, stub


def request(rid: str = "q", prompt=PROMPT, **kwargs) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(prompt), SamplingParams(max_tokens=2), **kwargs)


def pulls(result: str) -> float:
    return gateway_metrics().kv_prefix_pulls.labels(result)._value.get()


def test_the_routed_request_carries_the_lease_once_then_it_is_released():
    answer = kpb.LeasePrefixResponse()
    answer.kv_transfer_params.lease_id = "L"
    answer.kv_transfer_params.block_hashes.extend(HASHES[:8])
    answer.kv_transfer_params.remote_block_ids.extend(range(8))
    before = pulls("leased")
    r, stub = pulled(answer, [request("a"), request("b"), request("c", prompt=PROMPT[:50])])
    [asked] = stub.asked
    assert list(asked.block_hashes) == HASHES[:8] and list(asked.token_ids) == PROMPT[:8 * BS]
    assert asked.min_blocks == 1 + 4 and asked.request_id == "a.prefix"
    first, second, other = r.sent
    assert first.kv_transfer_params.do_remote_prefill
    assert first.kv_transfer_params.block_hashes == HASHES[:8]
    assert second.kv_transfer_params is None and other.kv_transfer_params is None
    assert stub.released == ["L"] and pulls("leased") == before + 1


def test_a_lease_asks_the_source_s_tiers_with_the_salt_and_a_longer_wait():
    """Every lease asks the source's tiers too (the index may count as device blocks
    what it has evicted since); it counts as a tier pull when the source says it
    onloaded some. A LoRA request asks for the device run only, and waits less."""
    answer = kpb.LeasePrefixResponse(num_tier_blocks=1)
    answer.kv_transfer_params.lease_id = "T"
    tier_pulls = gateway_metrics().kv_prefix_tier_pulls.labels("leased")
    before = tier_pulls._value.get()
    r, stub = pulled(answer, [request("a", cache_salt="tenant-1")], tiers={"s": (1, 0)})
    [asked] = stub.asked
    assert asked.from_tier and asked.cache_salt == "tenant-1" and len(asked.block_hashes) == 9
    assert stub.timeouts == [prefix_pull.TIER_LEASE_TIMEOUT_S]
    assert r.sent[0].kv_transfer_params.lease_id == "T"
    assert tier_pulls._value.get() == before + 1
    # The source held it all on its device: not a tier pull.
    device_only = kpb.LeasePrefixResponse()
    device_only.kv_transfer_params.lease_id = "D"
    r, stub = pulled(device_only, [request("b")])
    assert stub.asked[0].from_tier and tier_pulls._value.get() == before + 1
    from pagoda.lora.request import LoRARequest
    r, stub = pulled(answer, [request("c", lora_request=LoRARequest("a1", 1, "/x"))],
                     tiers={"s": (1, 0)}, lora=LoRARequest("a1", 1, "/x"))
    assert not stub.asked[0].from_tier and stub.timeouts == [prefix_pull.LEASE_TIMEOUT_S]


@pytest.mark.parametrize("answer, result", [
    (grpc.StatusCode.UNAVAILABLE, "lease_failed"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "lease_failed"),
    (kpb.LeasePrefixResponse(), "too_few_blocks"),
])
def test_no_lease_means_the_request_as_it_was(answer, result):
    before = pulls(result)
    r, stub = pulled(answer, [request()])
    assert [q.kv_transfer_params for q in r.sent] == [None] and stub.released == []
    assert pulls(result) == before + 1


def test_decodes_resumed_and_scoring_requests_pass_through():
    scoring = request()
    scoring.sampling_params = SamplingParams(max_tokens=2, prompt_logprobs=1)
    p_d_decode = request(output_token_ids=[5], kv_transfer_params=KVTransferParams(
        do_remote_prefill=True, block_hashes=HASHES[:3], remote_block_ids=[1, 2, 3]))
    r, stub = pulled(grpc.StatusCode.UNAVAILABLE,
                     [p_d_decode, request(output_token_ids=[5]), scoring])
    assert stub.asked == [] and len(r.sent) == 3
    assert r.sent[0].kv_transfer_params is p_d_decode.kv_transfer_params  # its prefill's


def test_flags():
    import argparse

    parser = argparse.ArgumentParser()
    prefix_pull.add_prefix_pull_args(parser)
    assert prefix_pull.prefix_pull_flags(parser.parse_args([])) == []
    args = parser.parse_args(["--kv-prefix-pull", "--kv-prefix-pull-min-blocks", "2"])
    assert PrefixPullOptions.from_args(args) == PrefixPullOptions(True, 2)
    assert prefix_pull.prefix_pull_flags(args) == ["--kv-prefix-pull",
                                                   "--kv-prefix-pull-min-blocks", "2"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-prefix-pull-min-blocks", "0"])
