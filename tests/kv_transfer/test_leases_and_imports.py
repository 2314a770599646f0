"""Leases pin blocks until released or reaped; imports skip held blocks, take nothing
when they cannot fit, and leave the pool full once released."""

from __future__ import annotations

import pytest

from pagoda.core.block_hash import hash_request_tokens
from pagoda.core.block_pool import BlockPool
from pagoda.kv_transfer.config import KVTransferConfig
from pagoda.kv_transfer.imports import commit_import, plan_import, release_import
from pagoda.kv_transfer.leases import LeaseTable

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
    from pagoda.services.gateway.disagg.prefill_decode import handshake_problem

    def info(instance, block_size, dtype):
        msg = spb.GetModelInfoResponse(model="m", instance_id=instance)
        msg.kv_layout.block_size, msg.kv_layout.kv_dtype = block_size, dtype
        return msg

    assert handshake_problem(info("p", 16, "float32"), info("d", 16, "float32")) is None
    problem = handshake_problem(info("p", 16, "float32"), info("d", 32, "bfloat16"))
    assert "block_size 16 vs 32" in problem and "kv_dtype 'float32' vs 'bfloat16'" in problem
    assert "prefill p" in problem and "decode d" in problem


def test_handshake_compares_connectors_and_dist_devices_but_not_parallel_shapes():
    from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
    from pagoda.services.gateway.disagg.prefill_decode import handshake_problem

    def info(instance, connector="PagodaConnector", device="cpu", ranks=1):
        msg = spb.GetModelInfoResponse(model="m", instance_id=instance, kv_connector=connector)
        msg.kv_layout.device_type, msg.kv_layout.tensor_parallel_size = device, ranks
        msg.kv_layout.num_kv_heads, msg.kv_layout.num_layers = 8, 4
        return msg

    assert handshake_problem(info("p", ranks=1), info("d", ranks=2)) is None
    problem = handshake_problem(info("p"), info("d", "PagodaDistConnector"))
    assert "kv_connector 'PagodaConnector' vs 'PagodaDistConnector'" in problem
    dist = "PagodaDistConnector"
    assert "device_type 'cuda' vs 'cpu'" in handshake_problem(info("p", dist, "cuda"),
                                                             info("d", dist, "cpu"))
    # The gRPC transport moves bytes: a CPU prefill worker may feed a GPU decode one.
    assert handshake_problem(info("p", device="cpu"), info("d", device="cuda")) is None


def test_invalidate_ends_every_lease_and_frees_its_blocks():
    """The KV cache was set up again (zeros): no lease taken before may answer valid."""
    tokens = list(range(8))
    pool, hashes = cached_pool(tokens)
    table = LeaseTable(pool, timeout_s=30, clock=lambda: 0.0)
    first, second = table.pin("a", hashes, tokens), table.pin("b", hashes[:1], tokens)
    dropped = table.invalidate()
    assert {lease.lease_id for lease in dropped} == {first.lease_id, second.lease_id}
    assert not table.release(first.lease_id) and not table.release(second.lease_id)
    assert table.num_leased_blocks == 0 and not table.leases and pool.num_free_blocks == 8
