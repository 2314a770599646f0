"""Issue 31's failure contract under P/D with KV tiers on both replicas, real processes
(`pagoda serve --prefill-replicas 1 --decode-replicas 1`, supervised: a killed service
or replica is started again by `pagoda serve` after --restart-backoff):

- the kv-cache-manager SIGKILLed while prompts are prefilled, pulled and onloaded
  from the tiers: every answer is the offline float32 engine's (the index is never on a
  transfer's path); the tier events published while it is down are lost, so the index
  in Redis keeps entries the tiers dropped meanwhile. Once it is back, each replica's
  next batch shows the gap, the replica sends a snapshot of its device and publishes
  its tiers' blocks again: the index then holds none of the dropped blocks and the
  tier blocks each replica really holds (what it re-learns: exactly the tiers'
  contents, per medium). A tier entry the index holds wrongly (written into Redis
  here) is harmless: it can only steer routing, and the replica's own scheduler
  decides what it onloads (its index, checked again by the worker), so the revisit
  is computed: the same answer.
- a replica SIGKILLed and restarted: its new incarnation (a new epoch) starts with
  empty tiers, deletes its old disk-tier records, the index forgets every medium of
  the old incarnation's blocks, and the revisits it serves are recomputed, never read
  from the old records: the same answers.
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import redis
from pd_cluster import generate, metric, role_address, role_process, start_pd
from pd_tiers import (FAILED, HITS, MOVED, block_hashes, complete, offline_answers,
                      prompt_sets, replica_metric, request, tier_flags, tokens)
from serve_cluster import wait_until

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # a P/D cluster and two restarts
# 16 device blocks + 8 host slots + 16 disk records: 40 blocks per replica. The ten
# B prompts hold 50 full blocks, so after them no tier of the prefill replica holds an A
# block; the decode replica's device blocks that its pulls reuse are not offloaded (see
# pagoda.kv_transfer.imports), so it is given ten C prompts of its own to compute.
DISK_RECORDS = 16
BACKOFF_S = 15  # how long a killed service stays down: the B and C traffic runs meanwhile
MEDIA = ("", ":CPU", ":DISK")
RESYNCS = "pagoda_kv_index_resyncs_total"


def sets_a() -> list[list[int]]:
    return prompt_sets(4, seed=31)[0]


def sets_b() -> list[list[int]]:
    return prompt_sets(10, seed=32)[0]


def sets_c() -> list[list[int]]:
    return prompt_sets(10, seed=33)[0]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return offline_answers(tiny_llama_dir, sets_a() + sets_b() + sets_c())


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, redis_server, disk_dir):
    serve = start_pd(tiny_llama_dir, redis_server.url,
                     *tier_flags(disk_dir, DISK_RECORDS), "--restart-backoff", str(BACKOFF_S))
    yield serve
    serve.stop()


@pytest.fixture(scope="module")
def store(redis_server):
    return redis.Redis.from_url(redis_server.url)


def by_medium(store, instance: str, hashes: list[bytes]) -> dict[str, int]:
    return {medium or "GPU": indexed(store, instance, hashes, (medium,)) for medium in MEDIA}


def indexed(store, instance: str, hashes: list[bytes], media=MEDIA) -> int:
    """How many (block, medium) entries the index holds for `instance` among `hashes`."""
    keys = [key for medium in media
            for key in store.keys(f"pagoda:kv:*:inst:{instance}:blocks{medium}")]
    return sum(store.sismember(key, h.hex()) for key in keys for h in hashes)


def full_hashes(address: str, prompts) -> list[bytes]:
    return [h for p in prompts for h in block_hashes(address, p)]


def epoch(address: str) -> str | None:
    try:
        with grpc.insecure_channel(address) as channel:
            return spb_grpc.SchedulerServiceStub(channel).GetModelInfo(
                spb.GetModelInfoRequest(), timeout=2).epoch
    except grpc.RpcError:
        return None


def manager_pid(serve) -> int | None:
    try:
        return serve.service_pid("kv-cache-manager")
    except Exception:  # noqa: BLE001 (between its death and its restart)
        return None


def test_kv_cache_manager_killed_mid_transfer(pd, store, reference):
    prefill = role_address(pd, "scheduler", "kv_producer")
    decode = role_address(pd, "scheduler", "kv_consumer")
    a, b, c = sets_a(), sets_b(), sets_c()
    a_hashes = full_hashes(prefill, a)

    for prompt in a:
        assert complete(pd, prompt) == reference[tuple(prompt)]
    # The index learnt A, in the tiers too, on both replicas.
    for instance in (prefill, decode):
        assert wait_until(lambda: indexed(store, instance, a_hashes, (":CPU", ":DISK")), 10)

    # B through the gateway, 3 at a time; the manager dies once transfers are under way.
    victim = manager_pid(pd)
    moved = metric(pd, MOVED)
    with ThreadPoolExecutor(3) as pool:
        answers = [pool.submit(complete, pd, prompt) for prompt in b]
        assert wait_until(lambda: metric(pd, MOVED) > moved, 60)
        psutil.Process(victim).send_signal(signal.SIGKILL)
        local = [tokens(generate(decode, request(f"c-{i}", p))) for i, p in enumerate(c)]
        got = [answer.result() for answer in answers]
    assert got == [reference[tuple(p)] for p in b]
    assert local == [reference[tuple(p)] for p in c]
    # (Fewer than 5 a prompt: three pulls at once may not all fit the 16-block pool.)
    assert metric(pd, MOVED) - moved >= 2 * len(b)

    # Back (restarted by `pagoda serve`): the replicas resynced; the index holds no A
    # block in any medium (the tiers dropped them all while it was down) and B's tier
    # blocks on both replicas.
    assert wait_until(lambda: manager_pid(pd) not in (None, victim), 60)
    b_hashes = full_hashes(prefill, b)
    # The new manager's counter starts at 0: both replicas resynced with it.
    assert wait_until(lambda: metric(pd, RESYNCS) >= 2, 60), metric(pd, RESYNCS)
    for instance in (prefill, decode):
        assert wait_until(lambda: indexed(store, instance, a_hashes) == 0, 30), \
            (instance, by_medium(store, instance, a_hashes))
        assert wait_until(lambda: indexed(store, instance, b_hashes, (":CPU",)) > 0, 30)
        assert wait_until(lambda: indexed(store, instance, b_hashes, (":DISK",)) > 0, 30)

    # A wrong tier entry (as a stale one would be): the decode replica "holds" A in its
    # host tier. A revisit (through the gateway, and straight to it) is computed there:
    # the reference's answer, no failed onload.
    for key in store.keys(f"pagoda:kv:*:inst:{decode}:blocks:CPU"):
        store.sadd(key, *[h.hex() for h in a_hashes])
    for i, prompt in enumerate(a):
        assert complete(pd, prompt) == reference[tuple(prompt)]
        assert tokens(generate(decode, request(f"stale-{i}", prompt))) == \
            reference[tuple(prompt)]
    assert metric(pd, FAILED) == 0


def test_a_restarted_replica_drops_its_tiers(pd, store, reference, disk_dir):
    decode = role_address(pd, "scheduler", "kv_consumer")
    b = sets_b()
    # The decode replica's tiers hold B (pulled, then evicted by the later prompts).
    for i, prompt in enumerate(b):
        assert tokens(generate(decode, request(f"warm-{i}", prompt))) == \
            reference[tuple(prompt)]
    b_hashes = full_hashes(decode, b)
    assert wait_until(lambda: indexed(store, decode, b_hashes, (":CPU", ":DISK")) > 0, 10)
    old_epoch = epoch(decode)
    old_dirs = {p.name for p in disk_dir.glob("*/epoch-*")}
    assert len(old_dirs) == 2, old_dirs  # one per replica

    processes = [role_process(pd, kind, "kv_consumer") for kind in ("gpu-worker", "scheduler")]
    for process in processes:
        process.kill()
    new_epoch = wait_until(lambda: (e := epoch(decode)) not in (None, old_epoch) and e, 120)
    assert new_epoch, "the decode replica was not restarted"
    # Its old records are gone (the prefill replica's stay), and the index forgot
    # every medium of its old incarnation's blocks.
    new_dirs = {p.name for p in disk_dir.glob("*/epoch-*")}
    assert len(new_dirs) == 2 and len(new_dirs & old_dirs) == 1, (old_dirs, new_dirs)
    assert wait_until(lambda: indexed(store, decode, b_hashes) == 0, 30)

    # The revisits it serves itself are computed (no old record is read) and equal.
    for i, prompt in enumerate(b[:4]):
        assert tokens(generate(decode, request(f"after-{i}", prompt))) == \
            reference[tuple(prompt)]
    assert replica_metric(pd, "kv_consumer", HITS) == 0
    assert replica_metric(pd, "kv_consumer", FAILED) == 0
    # Through the gateway (prefilled, pulled again) as well.
    for prompt in b[4:]:
        assert complete(pd, prompt) == reference[tuple(prompt)]
