"""Leases pin blocks until released or reaped; imports skip held blocks, take nothing
when they cannot fit, and leave the pool full once released."""

from __future__ import annotations

import pytest
import torch

from pagoda.core.block_hash import hash_request_tokens
from pagoda.core.block_pool import BlockPool
from pagoda.kv_transfer.config import KVTransferConfig
from pagoda.kv_transfer.imports import commit_import, plan_import, release_import
from pagoda.kv_transfer.leases import LeaseTable
from pagoda.worker.kv_blocks import block_nbytes, export_block, import_block, import_blocks

BS = 4


def cached_pool(tokens: list[int], num_blocks: int = 8) -> tuple[BlockPool, list[bytes]]:
    """A pool whose first blocks hold `tokens` as a freed, cached request would."""
    pool = BlockPool(num_blocks, BS, enable_caching=True)
    hashes = hash_request_tokens(tokens, BS, "seed")
    blocks = pool.get_new_blocks(len(hashes))
    pool.cache_full_blocks(blocks, hashes, tokens, 0, len(hashes))
    pool.free_blocks(reversed(blocks))
    return pool, hashes


def test_lease_pins_until_release_then_blocks_are_free():
    tokens = list(range(10))
    pool, hashes = cached_pool(tokens)
    table = LeaseTable(pool, timeout_s=30, clock=lambda: 100.0)
    lease = table.pin("r", hashes, tokens)
    assert len(lease.blocks) == 2 and pool.num_free_blocks == 6
    pool.get_new_blocks(6)  # everything else is taken: the leased blocks are not reusable
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    assert table.release(lease.lease_id) and not table.release(lease.lease_id)
    assert table.num_leased_blocks == 0 and pool.num_free_blocks == 2


def test_reaper_frees_expired_leases_only():
    tokens = list(range(8))
    pool, hashes = cached_pool(tokens)
    now = [0.0]
    table = LeaseTable(pool, timeout_s=5, clock=lambda: now[0])
    first = table.pin("a", hashes, tokens)
    now[0] = 3.0
    second = table.pin("b", hashes[:1], tokens)
    now[0] = 6.0
    assert [lease.lease_id for lease in table.reap()] == [first.lease_id]
    assert not table.release(first.lease_id)  # expired: the puller must discard its copy
    assert table.release(second.lease_id) and pool.num_free_blocks == 8


def test_import_skips_held_blocks_and_commits_the_pulled_ones():
    tokens = list(range(100, 116))  # 4 blocks
    hashes = hash_request_tokens(tokens, BS, "seed")
    pool, _ = cached_pool(tokens[:8])  # the first two blocks are here already
    plan = plan_import(pool, hashes, tokens)
    assert len(plan.held) == 2 and plan.remote_indices == [2, 3]
    commit_import(pool, plan, ok=True)
    release_import(pool, plan)
    release_import(pool, plan)  # idempotent
    assert pool.num_free_blocks == 8
    assert all(pool.get_cached_block(h, tokens[i * BS:(i + 1) * BS]) for i, h in enumerate(hashes))


def test_failed_import_caches_nothing_and_a_full_pool_takes_nothing():
    tokens = list(range(16))
    hashes = hash_request_tokens(tokens, BS, "seed")
    pool = BlockPool(8, BS, enable_caching=True)
    plan = plan_import(pool, hashes, tokens)
    commit_import(pool, plan, ok=False)
    release_import(pool, plan)
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 0
    pool.get_new_blocks(7)
    small = plan_import(pool, hashes, tokens)
    assert small.num_blocks == 1 and len(small.targets) == 1  # the leading run that fits


def test_block_bytes_round_trip_between_caches():
    src = [(torch.randn(3, BS, 2, 8), torch.randn(3, BS, 2, 8)) for _ in range(2)]
    dst = [(torch.zeros(3, BS, 2, 8), torch.zeros(3, BS, 2, 8)) for _ in range(2)]
    data = export_block(src, 1)
    assert len(data) == block_nbytes(src)
    import_block(dst, 2, data)
    assert all(torch.equal(d[2], s[1]) for dl, sl in zip(dst, src) for d, s in zip(dl, sl))
    assert not dst[0][0][1].any()  # only the target block was written
    with pytest.raises(ValueError):
        import_block(dst, 0, data[:-4])


def test_many_blocks_import_at_once_like_one_by_one():
    src = [(torch.randn(6, BS, 2, 8).to(torch.bfloat16), torch.randn(6, BS, 2, 8).to(torch.bfloat16))
           for _ in range(3)]
    one = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    many = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in src]
    pairs = [(0, 5), (3, 1), (4, 2)]  # source block -> target block, out of order
    datas = [export_block(src, s) for s, _ in pairs]
    for (_, target), data in zip(pairs, datas):
        import_block(one, target, data)
    import_blocks(many, [t for _, t in pairs], datas)
    assert all(torch.equal(a, b) for la, lb in zip(one, many) for a, b in zip(la, lb))
    assert torch.equal(many[2][1][5], src[2][1][0])
    with pytest.raises(ValueError):  # one short block: nothing of the batch is written
        import_blocks(many, [0, 3], [datas[0], datas[1][:-2]])
    assert not many[0][0][0].any() and not many[0][0][3].any()


def test_kv_transfer_config_parses_vllm_json_and_names_bad_values():
    config = KVTransferConfig.from_json('{"kv_connector": "PagodaConnector", '
                                        '"kv_role": "kv_producer", "kv_rank": 0}')
    assert config.is_kv_producer and not config.is_kv_consumer
    assert KVTransferConfig.from_json(None).kv_role == "kv_both"
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.from_json('{"kv_role": "decoder"}')
    with pytest.raises(ValueError, match="NixlConnector"):
        KVTransferConfig.from_json('{"kv_connector": "NixlConnector"}')
    with pytest.raises(ValueError, match="bogus"):
        KVTransferConfig.from_json('{"bogus": 1}')


def test_handshake_names_both_sides_values():
    from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
    from pagoda.services.gateway.disagg import handshake_problem

    def info(instance, block_size, dtype):
        msg = spb.GetModelInfoResponse(model="m", instance_id=instance)
        msg.kv_layout.block_size, msg.kv_layout.kv_dtype = block_size, dtype
        return msg

    assert handshake_problem(info("p", 16, "float32"), info("d", 16, "float32")) is None
    problem = handshake_problem(info("p", 16, "float32"), info("d", 32, "bfloat16"))
    assert "block_size 16 vs 32" in problem and "kv_dtype 'float32' vs 'bfloat16'" in problem
    assert "prefill p" in problem and "decode d" in problem
