"""What a P/D decode replica is sent of a prompt's images: the same items without
pixels where the prefill's lease covers their runs, with them where it does not."""

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.services.gateway.disagg.media import decode_side_features


def item(offset, length, ident="a" * 64):
    return MultiModalFeature("image", ident, offset, length, data={"pixel_values": b"px"})


def lease(num_blocks):
    return KVTransferParams(do_remote_decode=True, block_hashes=[b"h"] * num_blocks)


def test_runs_inside_the_leased_blocks_go_without_pixels():
    features = [item(2, 8), item(12, 4, "b" * 64)]
    sent = decode_side_features(features, lease(4), 4)  # 16 tokens leased, runs end at 16
    assert [f.data for f in sent] == [None, None]
    assert [(f.identifier, f.offset, f.length) for f in sent] == \
        [(f.identifier, f.offset, f.length) for f in features]  # same block hashes
    assert features[0].data is not None  # the prefill side's request keeps its own


def test_a_run_past_the_lease_keeps_every_items_pixels():
    features = [item(2, 8), item(12, 5, "b" * 64)]  # ends at 17, in a block not leased
    assert all(f.data is not None for f in decode_side_features(features, lease(4), 4))
    assert all(f.data is not None for f in decode_side_features(features, lease(0), 4))


def test_a_prompt_without_images_is_unchanged():
    assert decode_side_features([], lease(3), 16) == []


# ---------------------------------------------------------------- through the gateway
import asyncio  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import grpc  # noqa: E402

from pagoda.core.media_guard import missing_encoder_input  # noqa: E402
from pagoda.messages import EngineCoreOutput, EngineCoreRequest, FinishReason  # noqa: E402
from pagoda.sampling_params import SamplingParams  # noqa: E402
from pagoda.services.gateway.disagg.prefill_decode import (Disaggregation,  # noqa: E402
                                                            DisaggregatedReplica)
from pagoda.services.gateway.routing.router import Route  # noqa: E402

BLOCK = 16
RUN = item(2, 20)  # ends at 22: inside the two leased blocks


class Prefill:
    def __init__(self) -> None:
        self.info = SimpleNamespace(kv_role="kv_producer", instance_id="prefill")
        self.address, self.instance_id = "prefill:1", "prefill"
        self.num_in_flight = self.num_pending_tokens = 0
        self.seen = []

    async def generate(self, request):
        self.seen.append(request)
        yield EngineCoreOutput(request.request_id, [7])
        yield EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.LENGTH,
                               kv_transfer_params=KVTransferParams(
                                   remote_scheduler_address="prefill:1", lease_id="l",
                                   block_hashes=[b"a", b"b"], remote_block_ids=[3, 4]))


class Decode:
    """A decode replica whose import covered `imported` tokens: it refuses, as its
    scheduler would (media_guard), to compute inside a run it has no pixels for."""

    def __init__(self, imported: int) -> None:
        self.info = SimpleNamespace(epoch="d", block_size=BLOCK)
        self.address, self.instance_id = "decode:1", "decode"
        self.imported = imported
        self.seen = []

    async def generate(self, request):
        self.seen.append(request)
        start = self.imported if request.kv_transfer_params is not None else 0
        why = missing_encoder_input(request.mm_features, start,
                                    len(request.prompt_token_ids) - start)
        if why is not None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details=why)
        yield EngineCoreOutput(request.request_id, [8], finish_reason=FinishReason.LENGTH)


def serve(decode: Decode) -> tuple[list[int], Prefill]:
    prefill = Prefill()
    router = SimpleNamespace(route=lambda *a: asyncio.sleep(0, Route(prefill, "test")))
    peers = SimpleNamespace(schedulers=[prefill], router=router, readiness_checks=[],
                            tokenizer=SimpleNamespace(stub=None))
    disagg = Disaggregation(peers)
    disagg.release_soon = lambda params: None
    request = EngineCoreRequest("r", list(range(40)), SamplingParams(max_tokens=2),
                                mm_features=[RUN])

    async def run() -> list[int]:
        return [t async for out in DisaggregatedReplica(disagg, decode).generate(request)
                for t in out.new_token_ids]

    return asyncio.run(run()), prefill


def test_the_prefill_side_gets_pixels_and_the_decode_side_none():
    decode = Decode(imported=2 * BLOCK)
    tokens, prefill = serve(decode)
    assert tokens == [7, 8]
    assert prefill.seen[0].mm_features[0].data is not None
    assert [r.mm_features[0].data for r in decode.seen] == [None]
    assert decode.seen[0].mm_features[0].identifier == RUN.identifier


def test_a_decode_side_short_of_the_images_kv_gets_the_pixels_after_all():
    decode = Decode(imported=0)  # its pull failed: it would have to encode
    tokens, _ = serve(decode)
    assert tokens == [7, 8]  # the client sees no error
    first, again = decode.seen
    assert first.mm_features[0].data is None and first.kv_transfer_params is not None
    assert again.mm_features[0].data is not None and again.kv_transfer_params is None
    assert again.output_token_ids == [7]
