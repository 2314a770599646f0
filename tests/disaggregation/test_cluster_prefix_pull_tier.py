"""A replica pulls a prefix that its peer holds only in its host KV tier, with real
processes: `pagoda serve --data-parallel-size 2 --router session --kv-prefix-pull` with
a 24-block device pool and a host tier on each replica (S = 0, R = 1, as in
test_cluster_prefix_pull.py), PAGODA_FAULT_INJECT=@file in every process.

Each case puts a 6-block prefix on S, evicts it from S's device into S's host tier
(fillers), waits until the cluster index says so, then sends the prefix to R:
- S onloads the run from its tier, leases it, R pulls it: the greedy answer equals a
  from-scratch computation, cached_tokens counts the pulled blocks;
- a tier block that fails its checksum on S's onload: S recomputes it, the pull still
  brings the whole run, the answer is the same;
- S's onload stalls past the gateway's wait: R computes the prompt, S aborts the
  onload and strands no lease;
- a lease whose cache_salt does not give the caller's hashes: S onloads and leases
  nothing;
- S's pull stream breaks mid-pull, then S's gpu-worker is SIGKILLed mid-pull: R
  computes the prompt each time, the same answer, nothing hangs;
- (another cluster, a 2-block host tier over a disk tier) the prefix comes from S's disk.
"""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from fault_file import FaultFile
from serve_cluster import wait_until
from test_cluster_prefix_pull import BS, PullCluster, flag, tokens

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as mpb
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as mpb_grpc
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc
from pagoda.services.gateway.disagg.prefix_pull import TIER_LEASE_TIMEOUT_S

# The pull itself runs in `make test` (~40 s with the cluster's start); the failure
# cases in make test-extended.
pytestmark = [pytest.mark.slow]
S, R = 0, 1
POOL_BLOCKS = 24
TINY_BLOCK_BYTES = 3 * 2 * BS * 2 * 16 * 4  # the tiny model's whole block, fp32
HOST_GIB = 512 * TINY_BLOCK_BYTES / 1024 ** 3
TIER_PULLS = "pagoda_gateway_kv_prefix_tier_pulls_total"
PULLS = "pagoda_gateway_kv_prefix_pulls_total"


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    return FaultFile(str(tmp_path_factory.mktemp("faults") / "faults.json"))


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir, redis_server, faults):
    cluster = PullCluster(tiny_llama_dir, redis_server.url, extra=(
        "--max-model-len", "256", "--num-gpu-blocks-override", str(POOL_BLOCKS),
        "--kv-offloading-backend", "native", "--kv-offloading-size", repr(HOST_GIB)),
        env=faults.env).start()
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def no_fault_left(faults):
    faults.arm()
    yield
    faults.arm()


def on_s_worker(cluster) -> str:
    """A fault's `process` naming S's gpu-worker alone."""
    return f"--port {flag(cluster.by_name['gpu-worker-0'].argv, '--port')}"


def prefix(case: int) -> list[int]:
    return [100 + case] + [(31 * case + 7 * i) % 20000 + 500 for i in range(1, 6 * BS)]


def lookup(cluster, prompt: list[int], salt: str = ""):
    with grpc.insecure_channel(cluster.tokenizer) as channel:
        hashes = tpb_grpc.TokenizerServiceStub(channel).Tokenize(tpb.TokenizeRequest(
            token_ids=tpb.TokenIds(token_ids=prompt), block_size=BS, cache_salt=salt),
            timeout=10).block_hashes
    with grpc.insecure_channel(cluster.index) as channel:
        reply = mpb_grpc.KvCacheManagerServiceStub(channel).LookupPrefix(
            mpb.LookupPrefixRequest(model=cluster.model, block_size=BS, block_hashes=hashes),
            timeout=10)
    return list(hashes), reply


def park_in_s_tier(cluster, case: int, disk: bool = False) -> list[int]:
    """The case's prefix, served by S and then evicted from S's device into its host
    tier (`disk`: on through a 2-block host tier to disk): the index says S holds it
    there, not on its device."""
    p = prefix(case)
    cluster.complete(p + [1, 2, 3], S)
    address = cluster.addresses[S]

    def parked() -> bool:
        _, reply = lookup(cluster, p)
        host, on_disk = reply.num_host_blocks.get(address, 0), \
            reply.num_disk_blocks.get(address, 0)
        return reply.num_cached_blocks.get(address, 0) == 0 and host + on_disk >= 6 \
            and (on_disk >= 4 if disk else host >= 6)

    for filler in range(8):  # 11-block prompts through a 24-block pool evict it
        if parked():
            return p
        cluster.complete([9000 + 100 * case + filler] + [7] * (10 * BS), S)
    assert wait_until(parked, 20), lookup(cluster, p)[1]
    return p


def fresh(cluster, prompt: list[int]):
    """R's answer computed from scratch (a salt no cache holds)."""
    _, want = cluster.complete(prompt, R, "plain", salt=f"scratch-{time.monotonic()}")
    assert want.usage.prompt_tokens_details.cached_tokens == 0
    return want


def pulled_blocks(cluster) -> float:
    return cluster.metric("gpu-worker-1", "pagoda_kv_transfer_blocks_total")


def leased_blocks(cluster) -> float:
    return cluster.metric("scheduler-0", "pagoda_kv_leased_blocks")


def test_r_pulls_what_s_holds_in_its_host_tier_and_answers_the_same(cluster):
    p = park_in_s_tier(cluster, 1)
    prompt = p + [21, 22, 23, 24]
    want = fresh(cluster, prompt)
    before = pulled_blocks(cluster)
    leased = cluster.gateway_metric("pull", TIER_PULLS, result="leased")
    s_blocks = cluster.metric("scheduler-0", "pagoda_kv_prefix_tier_lease_blocks_total")
    instance, got = cluster.complete(prompt, R)
    assert instance == cluster.addresses[R]
    assert wait_until(lambda: pulled_blocks(cluster) - before, 10) == 6
    assert tokens(got) == tokens(want)
    assert got.choices[0].logprobs.token_logprobs == pytest.approx(
        want.choices[0].logprobs.token_logprobs, abs=1e-3)
    assert got.usage.prompt_tokens_details.cached_tokens == 6 * BS
    assert cluster.gateway_metric("pull", TIER_PULLS, result="leased") == leased + 1
    assert cluster.metric("scheduler-0", "pagoda_kv_prefix_tier_lease_blocks_total") \
        == s_blocks + 6
    assert wait_until(lambda: leased_blocks(cluster) == 0, 10)  # R released the lease


@pytest.mark.extended
def test_a_tier_block_failing_its_checksum_on_s_is_recomputed_there(cluster, faults):
    p = park_in_s_tier(cluster, 2)
    prompt = p + [31, 32, 33]
    want = fresh(cluster, prompt)
    failed = cluster.metric("gpu-worker-0", "pagoda_kv_offload_failed_onloads_total")
    before = pulled_blocks(cluster)
    faults.arm({"point": "kv_onload.block", "action": "fail", "after": 2, "times": 2,
                "process": on_s_worker(cluster)})
    _, got = cluster.complete(prompt, R)
    assert tokens(got) == tokens(want)
    assert cluster.metric("gpu-worker-0", "pagoda_kv_offload_failed_onloads_total") >= failed + 1
    # S recomputed the bad blocks (and what follows them): the whole run is pulled.
    assert wait_until(lambda: pulled_blocks(cluster) - before, 10) == 6
    assert got.usage.prompt_tokens_details.cached_tokens == 6 * BS


@pytest.mark.extended
def test_an_onload_past_the_gateway_s_wait_means_r_computes(cluster, faults):
    p = park_in_s_tier(cluster, 3)
    prompt = p + [41, 42]
    want = fresh(cluster, prompt)
    # (counted in the tier pulls' counter only when the index already said "tier": it
    # may still count a recent route's blocks as on S's device)
    lease_failed = cluster.gateway_metric("pull", PULLS, result="lease_failed")
    s_failed = cluster.metric("scheduler-0", "pagoda_kv_prefix_tier_leases_total",
                              result="failed")
    before = pulled_blocks(cluster)
    faults.arm({"point": "kv_onload.block", "action": "delay",
                "seconds": TIER_LEASE_TIMEOUT_S + 3, "process": on_s_worker(cluster)})
    start = time.monotonic()
    _, got = cluster.complete(prompt, R)
    assert time.monotonic() - start < TIER_LEASE_TIMEOUT_S + 30
    assert tokens(got) == tokens(want)
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    assert pulled_blocks(cluster) == before
    assert cluster.gateway_metric("pull", PULLS, result="lease_failed") == lease_failed + 1
    assert wait_until(lambda: cluster.metric("scheduler-0", "pagoda_kv_prefix_tier_leases_total",
                                             result="failed") == s_failed + 1, 10)
    # The onload, aborted, strands no lease on S once its stalled copy ended (one
    # that went on to finish would lease the run then).
    time.sleep(max(0.0, start + 2 * TIER_LEASE_TIMEOUT_S + 6 - time.monotonic()))
    assert leased_blocks(cluster) == 0


@pytest.mark.extended
def test_another_salt_onloads_and_leases_nothing(cluster):
    p = park_in_s_tier(cluster, 4)
    hashes, _ = lookup(cluster, p)
    failed = cluster.metric("scheduler-0", "pagoda_kv_prefix_tier_leases_total",
                            result="failed")
    hits = cluster.metric("scheduler-0", "pagoda_kv_offload_hits_total")
    requests = cluster.metric("scheduler-0", "vllm:request_success_total")
    address = flag(cluster.by_name["gateway"].argv, "--scheduler-addrs").split(",")[S]
    with grpc.insecure_channel(address) as channel:
        reply = kpb_grpc.KvLeaseServiceStub(channel).LeasePrefix(kpb.LeasePrefixRequest(
            request_id="other-tenant", block_hashes=hashes[:6], token_ids=p[:6 * BS],
            min_blocks=1, from_tier=True, cache_salt="tenant-b"), timeout=10)
    assert not reply.HasField("kv_transfer_params")
    assert cluster.metric("scheduler-0", "pagoda_kv_prefix_tier_leases_total",
                          result="failed") == failed + 1
    assert cluster.metric("scheduler-0", "pagoda_kv_offload_hits_total") == hits
    # S ran no onload request (it would have computed the run under the other salt).
    time.sleep(1)
    assert cluster.metric("scheduler-0", "vllm:request_success_total") == requests
    _, reply = lookup(cluster, p)  # still in S's tier only: nothing was onloaded
    assert reply.num_cached_blocks.get(cluster.addresses[S], 0) == 0


@pytest.mark.extended
def test_a_pull_broken_or_its_source_killed_mid_pull_means_r_computes(cluster, faults):
    first, second = park_in_s_tier(cluster, 5), park_in_s_tier(cluster, 6)
    want = {tuple(p): tokens(fresh(cluster, p + [2])) for p in (first, second)}
    recomputed = cluster.metric("scheduler-1", "pagoda_kv_transfer_fallbacks_total",
                                kind="recompute")
    # The stream breaks after 2 blocks.
    faults.arm({"point": "kv_pull.block", "action": "fail", "after": 2,
                "process": on_s_worker(cluster)})
    _, got = cluster.complete(first + [2], R)
    assert tokens(got) == want[tuple(first)]
    assert cluster.metric("scheduler-1", "pagoda_kv_transfer_fallbacks_total",
                          kind="recompute") == recomputed + 1
    # The pull stalls after 2 blocks and S's gpu-worker dies there.
    faults.arm({"point": "kv_pull.block", "action": "delay", "seconds": 60, "after": 2,
                "process": on_s_worker(cluster)})
    stalled = cluster.metric("gpu-worker-1", "pagoda_kv_transfer_blocks_total")
    answers = []
    thread = threading.Thread(target=lambda: answers.append(cluster.complete(second + [2], R)))
    start = time.monotonic()
    thread.start()
    time.sleep(3)  # the onload and the lease, then the pull reaches the stall
    worker = cluster.by_name["gpu-worker-0"].process
    worker.send_signal(signal.SIGKILL)
    worker.wait(10)
    thread.join(120)
    assert answers, "the request did not answer"
    assert time.monotonic() - start < 90
    assert tokens(answers[0][1]) == want[tuple(second)]
    assert cluster.metric("scheduler-1", "pagoda_kv_transfer_fallbacks_total",
                          kind="recompute") == recomputed + 2
    assert cluster.metric("gpu-worker-1", "pagoda_kv_transfer_blocks_total") == stalled


@pytest.fixture(scope="module")
def disk_cluster(tiny_llama_dir, redis_server, tmp_path_factory):
    disk = tmp_path_factory.mktemp("kv-disk")
    cluster = PullCluster(tiny_llama_dir, redis_server.url, extra=(
        "--max-model-len", "256", "--num-gpu-blocks-override", str(POOL_BLOCKS),
        "--kv-offloading-backend", "native",
        "--kv-offloading-size", repr(2 * TINY_BLOCK_BYTES / 1024 ** 3),
        "--kv-offloading-disk-path", str(disk),
        "--kv-offloading-disk-size", repr(512 * 2 * TINY_BLOCK_BYTES / 1024 ** 3))).start()
    yield cluster
    cluster.stop()


@pytest.mark.extended
def test_r_pulls_what_s_holds_on_its_disk_tier(disk_cluster):
    """The same pull from S's disk tier (below a 2-block host tier): S onloads the
    records from disk first."""
    cluster = disk_cluster
    p = park_in_s_tier(cluster, 7, disk=True)
    prompt = p + [51, 52, 53]
    want = fresh(cluster, prompt)
    before = pulled_blocks(cluster)
    _, got = cluster.complete(prompt, R)
    assert wait_until(lambda: pulled_blocks(cluster) - before, 10) == 6
    assert tokens(got) == tokens(want)
    assert got.usage.prompt_tokens_details.cached_tokens == 6 * BS
    assert cluster.metric("scheduler-0", "pagoda_kv_offload_hits_total", tier="disk") >= 4
