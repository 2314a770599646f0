"""A client that leaves right after the prefill's first token: the gateway still reads
the prefill's end (which names the lease) and releases that lease at once, instead of
stranding it until the prefill replica's --kv-lease-timeout."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagoda.sampling_params import SamplingParams
from pagoda.services.gateway.disagg.prefill_decode import Disaggregation, DisaggregatedReplica
from pagoda.services.gateway.routing.router import Route

PARAMS = KVTransferParams(remote_scheduler_address="prefill:1", remote_epoch="e",
                          lease_id="lease-1", remote_block_ids=[3, 4])


class PrefillReplica:
    """A kv_producer replica: its first token, then its end with the lease."""

    def __init__(self) -> None:
        self.info = SimpleNamespace(kv_role="kv_producer", instance_id="prefill")
        self.address, self.instance_id = "prefill:1", "prefill"
        self.num_in_flight = self.num_pending_tokens = 0

    async def generate(self, request):
        yield EngineCoreOutput(request.request_id, [7])
        await asyncio.sleep(0.05)  # the end comes a moment later
        yield EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.LENGTH,
                               kv_transfer_params=PARAMS)


class Router:
    def __init__(self, replica) -> None:
        self.replica = replica

    async def route(self, views, route_request, tokenizer):
        return Route(self.replica, "test")


def test_a_client_leaving_after_the_first_token_has_its_lease_released():
    prefill = PrefillReplica()
    peers = SimpleNamespace(schedulers=[prefill], router=Router(prefill), readiness_checks=[],
                            tokenizer=SimpleNamespace(stub=None))
    disagg = Disaggregation(peers)
    released: list[KVTransferParams] = []
    disagg.release_soon = released.append
    decode = SimpleNamespace(info=SimpleNamespace(epoch="d"), instance_id="decode")
    request = EngineCoreRequest("r", list(range(40)), SamplingParams(max_tokens=50))

    async def leave_after_first_token() -> None:
        stream = DisaggregatedReplica(disagg, decode).generate(request)
        first = await stream.__anext__()
        assert first.new_token_ids == [7]
        await stream.aclose()  # the client is gone
        for _ in range(100):
            if released:
                return
            await asyncio.sleep(0.01)

    asyncio.run(leave_after_first_token())
    assert released == [PARAMS]
    assert prefill.num_in_flight == 0  # the route's load was given back too
