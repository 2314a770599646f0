"""The prefix index records what schedulers report, in a real Redis."""

from __future__ import annotations

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as pb
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as pb_grpc
from pagoda.core.block_hash import hash_request_tokens
from pagoda.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagoda.services.common.protocol.kv_events import publish_request
from pagoda.services.kv_cache_manager.index import PrefixIndex
from pagoda.services.kv_cache_manager.servicer import KvCacheManagerServicer

SEED = "test-seed"
MODEL = "m"


def hashes(tokens, block_size=4):
    return hash_request_tokens(tokens, block_size, SEED)


def stored(hs, block_size=4):
    return BlockStored(list(hs), None, list(range(len(hs) * block_size)), block_size)


def test_stored_blocks_give_longest_prefix_per_instance(redis_client):
    index = PrefixIndex(redis_client)
    a = hashes(list(range(16)))           # 4 blocks
    b = hashes(list(range(8)) + [99] * 8)  # shares 2 leading blocks with a
    index.apply(MODEL, 4, "s1", "e1", 0, [stored(a)])
    index.apply(MODEL, 4, "s2", "e1", 0, [stored(b[:3])])
    assert index.lookup(MODEL, 4, a) == {"s1": 4, "s2": 2}
    assert index.lookup(MODEL, 4, b) == {"s1": 2, "s2": 3}
    assert index.lookup(MODEL, 4, hashes([7] * 8)) == {}


def test_removed_and_cleared_blocks_leave_the_index(redis_client):
    index = PrefixIndex(redis_client)
    a = hashes(list(range(16)))
    index.apply(MODEL, 4, "s1", "e1", 0, [stored(a), BlockRemoved([a[2]])])
    assert index.lookup(MODEL, 4, a) == {"s1": 2}
    assert index.instance_blocks(MODEL, 4, "s1") == {a[0], a[1], a[3]}
    reply = index.apply(MODEL, 4, "s1", "e1", 1, [AllBlocksCleared(), stored(a[:1])])
    assert reply.num_blocks == 1 and not reply.resync_required
    assert index.lookup(MODEL, 4, a) == {"s1": 1}


def test_new_epoch_drops_the_old_entries(redis_client):
    index = PrefixIndex(redis_client)
    a = hashes(list(range(16)))
    index.apply(MODEL, 4, "s1", "e1", 0, [stored(a)])
    index.apply(MODEL, 4, "s1", "e2", 0, [stored(a[:1])])
    assert index.lookup(MODEL, 4, a) == {"s1": 1}


def test_namespaces_keep_models_and_block_sizes_apart(redis_client):
    index = PrefixIndex(redis_client)
    a = hashes(list(range(16)))
    index.apply("m1", 4, "s1", "e1", 0, [stored(a)])
    assert index.lookup("m2", 4, a) == {}
    assert index.lookup("m1", 8, a) == {}
    assert index.lookup("m1", 4, a) == {"s1": 4}


def test_grpc_publish_then_lookup(redis_client, grpc_server_factory):
    served = grpc_server_factory(pb_grpc.add_KvCacheManagerServiceServicer_to_server,
                                 KvCacheManagerServicer(PrefixIndex(redis_client)))
    stub = pb_grpc.KvCacheManagerServiceStub(served.channel)
    a = hashes(list(range(12)))
    reply = stub.PublishKvEvents(publish_request("s1", MODEL, 4, "e1", 0, [stored(a)]))
    assert reply.num_blocks == 3
    found = stub.LookupPrefix(pb.LookupPrefixRequest(model=MODEL, block_size=4, block_hashes=a))
    assert dict(found.num_cached_blocks) == {"s1": 3}


def test_a_sequence_gap_asks_for_a_snapshot_which_replaces_the_entries(redis_client):
    index = PrefixIndex(redis_client)
    a, b = hashes(list(range(16))), hashes([5] * 16)
    index.apply(MODEL, 4, "s1", "e1", 0, [stored(a)])
    # Batch 1 (storing b, evicting a) was lost; batch 2 must not be applied.
    reply = index.apply(MODEL, 4, "s1", "e1", 2, [BlockRemoved([b[3]])])
    assert reply.resync_required
    assert index.apply(MODEL, 4, "s1", "e1", 3, []).resync_required  # still owed
    assert index.heartbeat(MODEL, 4, "s1", "e1", 4).resync_required
    reply = index.apply(MODEL, 4, "s1", "e1", 4, [stored(b[3:])], snapshot=b[:3])
    assert not reply.resync_required and reply.num_blocks == 4
    assert index.instance_blocks(MODEL, 4, "s1") == set(b)
    assert index.lookup(MODEL, 4, a) == {} and index.lookup(MODEL, 4, b) == {"s1": 4}
    assert not index.apply(MODEL, 4, "s1", "e1", 5, []).resync_required


def test_a_repeated_batch_is_acknowledged_but_not_reapplied(redis_client):
    index = PrefixIndex(redis_client)
    a = hashes(list(range(16)))
    index.apply(MODEL, 4, "s1", "e1", 0, [stored(a)])
    index.apply(MODEL, 4, "s1", "e1", 1, [BlockRemoved([a[0]])])
    reply = index.apply(MODEL, 4, "s1", "e1", 0, [stored(a)])
    assert not reply.resync_required and reply.num_blocks == 3


def test_an_instance_the_index_does_not_know_must_resync(redis_client):
    index = PrefixIndex(redis_client)
    assert not index.heartbeat(MODEL, 4, "s1", "e1", 0).resync_required  # nothing sent yet
    # A kv-cache-manager on a flushed Redis meets an instance that sent 7 batches.
    assert index.heartbeat(MODEL, 4, "s2", "e1", 7).resync_required
    assert index.apply(MODEL, 4, "s3", "e1", 7, [stored(hashes(list(range(8))))]).resync_required
    assert index.instance_blocks(MODEL, 4, "s3") == set()


def test_a_lapsed_heartbeat_hides_then_drops_the_instance(redis_client):
    now = [1000.0]
    index = PrefixIndex(redis_client, heartbeat_timeout=5.0, clock=lambda: now[0])
    a = hashes(list(range(16)))
    index.apply(MODEL, 4, "s1", "e1", 0, [stored(a)])
    index.apply(MODEL, 4, "s2", "e1", 0, [stored(a[:2])])
    now[0] += 4.0
    index.heartbeat(MODEL, 4, "s2", "e1", 1)
    assert index.reap() == [] and index.lookup(MODEL, 4, a) == {"s1": 4, "s2": 2}
    now[0] += 2.0  # s1 last seen 6 s ago, s2 2 s ago
    assert index.lookup(MODEL, 4, a) == {"s2": 2}  # hidden before the reaper runs
    assert index.reap() == [(MODEL, "s1")]
    assert index.instance_blocks(MODEL, 4, "s1") == set()
    assert [i.instance_id for i in index.list_instances(MODEL, 4)] == ["s2"]
    assert not redis_client.exists(f"pagoda:kv:{MODEL}:4:block:{a[3].hex()}")
    # It comes back (it was only partitioned): the index asks for a snapshot.
    assert index.heartbeat(MODEL, 4, "s1", "e1", 1).resync_required


def test_deregister_drops_the_instance_but_not_a_newer_epoch(redis_client):
    index = PrefixIndex(redis_client)
    a = hashes(list(range(16)))
    index.apply(MODEL, 4, "s1", "e2", 0, [stored(a)])
    assert index.deregister(MODEL, 4, "s1", "e1") == 0  # an old process's late goodbye
    assert index.lookup(MODEL, 4, a) == {"s1": 4}
    assert index.deregister(MODEL, 4, "s1", "e2") == 4
    assert index.lookup(MODEL, 4, a) == {} and index.list_instances(MODEL, 4) == []


def test_an_instance_seen_again_while_the_reaper_scans_is_kept(redis_client, monkeypatch):
    """A restarted incarnation that registers between the reaper's scan and its drop
    keeps its entries (and its leases): the reaper re-checks before dropping."""
    now = [1000.0]
    index = PrefixIndex(redis_client, heartbeat_timeout=5.0, clock=lambda: now[0])
    a = hashes(list(range(16)))
    index.apply(MODEL, 4, "s1", "e1", 0, [stored(a)])
    now[0] += 6.0
    scan = redis_client.zrangebyscore

    def scan_then_register(*args, **kwargs):
        found = scan(*args, **kwargs)
        index.apply(MODEL, 4, "s1", "e2", 0, [stored(a[:2])])  # the new incarnation
        return found

    monkeypatch.setattr(redis_client, "zrangebyscore", scan_then_register)
    assert index.reap() == []
    monkeypatch.undo()
    assert [i.instance_id for i in index.list_instances(MODEL, 4)] == ["s1"]
    assert index.lookup(MODEL, 4, a) == {"s1": 2}
