"""The gateway's readiness in a prefill/decode cluster (disagg/prefill_decode.py): /health's
reason stays set until a routable decode replica pairs with a prefill replica; a pair that
cannot exchange blocks is fatal before the gateway was ever ready, and later is logged and
counted (once per pair of incarnations, naming the field) while the gateway keeps serving."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services.gateway.disagg.prefill_decode import disaggregation_of
from pagoda.services.gateway.observability.metrics import gateway_metrics
from pagoda.services.gateway.routing.peers import Peers


@dataclass
class Replica:
    address: str
    kv_role: str
    block_size: int = 16
    seed: str = "s"
    epoch: int = 1
    serving: bool = True
    removed: bool = False
    hashes_agree: bool | None = True

    @property
    def instance_id(self) -> str:
        return self.address

    @property
    def info(self) -> spb.GetModelInfoResponse:
        info = spb.GetModelInfoResponse(model="m", block_size=self.block_size,
                                        instance_id=self.address, kv_role=self.kv_role,
                                        epoch=f"{self.address}-{self.epoch}")
        info.kv_layout.CopyFrom(kpb.KvLayout(model="m", kv_dtype="float32",
                                             block_size=self.block_size, layout="l",
                                             prefix_hash_seed=self.seed))
        return info

    def is_routable(self) -> bool:
        return self.serving and self.hashes_agree is True and self.kv_role != "kv_producer"


def mismatches(name: str) -> float:
    return gateway_metrics().disagg_handshake_mismatches.labels(name)._value.get()


def with_peers(test) -> None:
    async def main() -> None:
        fatal: list[str] = []
        peers = Peers("127.0.0.1:1", "127.0.0.1:2", on_fatal=fatal.append)
        peers.tokenizer.serving, peers.tokenizer.info = True, tpb.GetTokenizerInfoResponse()
        disaggregation_of(peers)
        real = peers.schedulers
        try:
            test(peers, fatal)
        finally:
            peers.schedulers = real  # the fakes have no channel to close
            await peers.close()
    asyncio.run(main())


def test_colocated_replicas_need_no_pair():
    def test(peers, fatal):
        peers.schedulers = [Replica("a", "kv_both")]
        assert peers.not_ready_reason() is None
    with_peers(test)


def test_not_ready_until_a_compatible_prefill_replica_serves():
    def test(peers, fatal):
        prefill, decode = Replica("p", "kv_producer", serving=False), Replica("d", "kv_consumer")
        peers.schedulers = [prefill, decode]
        assert "no prefill (kv_producer) replica" in peers.not_ready_reason()
        prefill.serving = True
        assert peers.not_ready_reason() is None and not fatal
    with_peers(test)


def test_a_mismatch_before_ready_is_fatal_and_names_the_field():
    def test(peers, fatal):
        before = mismatches("block_size")
        peers.schedulers = [Replica("p", "kv_producer", block_size=32),
                            Replica("d", "kv_consumer")]
        reason = peers.not_ready_reason()
        assert "block_size 32 vs 16" in reason
        assert fatal and "block_size 32 vs 16" in fatal[0]
        peers.not_ready_reason()
        assert mismatches("block_size") == before + 1  # once per pair of incarnations
    with_peers(test)


def test_a_mismatch_after_ready_is_loud_but_leaves_the_gateway_serving():
    """After start-up a mismatched pair falls back (decode-side prefill), logged and
    counted: the gateway stays ready, since behind a readiness probe an unready gateway
    is an outage."""
    def test(peers, fatal):
        prefill, decode = Replica("p", "kv_producer"), Replica("d", "kv_consumer")
        peers.schedulers = [prefill, decode]
        assert peers.not_ready_reason() is None
        peers.ready.set()
        before = mismatches("prefix_hash_seed")
        prefill.seed, prefill.epoch = "other", 2  # restarted with another hash seed
        assert peers.not_ready_reason() is None and peers.is_healthy() and not fatal
        reason = peers.readiness_checks[0]()
        assert "cannot exchange KV blocks" in reason and "prefix_hash_seed 'other' vs 's'" \
            in reason
        assert mismatches("prefix_hash_seed") == before + 1
    with_peers(test)


def test_a_latent_cache_pairs_only_with_a_latent_of_its_size():
    """DeepSeek's latent blocks (one part of kv_lora_rank + qk_rope_head_dim values per
    token and layer) carry their layout and size in the handshake: another latent size,
    or a K/V cache of the same byte size, is refused naming the field."""
    import torch

    from pagoda.kv_transfer.block_shares import BlockShape
    from pagoda.services.gateway.disagg.prefill_decode import handshake_mismatches

    def info(shape: BlockShape) -> spb.GetModelInfoResponse:
        reply = spb.GetModelInfoResponse(model="m")
        reply.kv_layout.CopyFrom(kpb.KvLayout(
            model="m", kv_dtype="float32", block_size=shape.block_size,
            num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim, layout=shape.layout, prefix_hash_seed="s"))
        return reply

    v3 = BlockShape(3, 16, 1, 576, torch.float32, num_parts=1)
    assert handshake_mismatches(info(v3), info(v3)) == []
    other = BlockShape(3, 16, 1, 512, torch.float32, num_parts=1)
    assert handshake_mismatches(info(v3), info(other)) == [("head_dim", "576 vs 512")]
    kv = BlockShape(3, 16, 1, 288, torch.float32)  # the same bytes per block as `v3`
    assert kv.nbytes == v3.nbytes
    assert ("layout", "'blocks_tokens_latent' vs 'blocks_tokens_heads_dim'") in \
        handshake_mismatches(info(v3), info(kv))
