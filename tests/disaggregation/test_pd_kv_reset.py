"""A prefill replica's gpu-worker whose KV cache is set up again (zeros: what a failed
step's recovery or a restarted scheduler does) while a lease on its blocks is live,
with real processes: a pull naming the worker's epoch of before is refused
(FAILED_PRECONDITION, counted as stale_epoch), and the decode replica handed that lease
recomputes the prompt: the same greedy tokens as computing it there, also for a later
request sharing the prefix (nothing zeroed was cached under the prompt's hashes).
The prefill scheduler's own side (its leases ended, its cached hashes forgotten) is in
tests/services/scheduler/test_kv_reset_and_abort.py."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from pd_cluster import generate, metric, role_address, start_pd
from serve_cluster import wait_until

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.messages import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as wpb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
PROMPT = list(range(5, 70))  # 4 full blocks of 16 and one token
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, redis_server):
    serve = start_pd(tiny_llama_dir, redis_server.url, "--kv-lease-timeout", "120")
    yield serve
    serve.stop()  # its prefill replica is broken on purpose: no exit code to check


def prefill(address: str, request_id: str) -> KVTransferParams:
    request = EngineCoreRequest(request_id, list(PROMPT), replace(GREEDY, max_tokens=1),
                                eos_token_ids=[0],
                                kv_transfer_params=KVTransferParams(do_remote_decode=True))
    params = generate(address, request)[-1].kv_transfer_params
    assert params is not None and len(params.remote_block_ids) == 4
    return params


def decode(address: str, request_id: str, first: int, params) -> list[int]:
    request = EngineCoreRequest(request_id, list(PROMPT), GREEDY, eos_token_ids=[0],
                                output_token_ids=[first],
                                kv_transfer_params=replace(params, do_remote_prefill=True))
    return [t for out in generate(address, request) for t in out.new_token_ids]


def test_a_lease_on_a_reallocated_kv_cache_is_refused_and_recomputed(pd):
    producer = role_address(pd, "scheduler", "kv_producer")
    consumer = role_address(pd, "scheduler", "kv_consumer")
    # The decode replica's own answer (under a salt: no hit for the requests below).
    local = EngineCoreRequest("local", list(PROMPT), GREEDY, eos_token_ids=[0],
                              cache_salt="local")
    want = [t for out in generate(consumer, local) for t in out.new_token_ids]
    params = prefill(producer, "before")
    with grpc.insecure_channel(params.remote_worker_address) as channel:
        num_blocks = kpb_grpc.KvTransferServiceStub(channel).GetKvLayout(
            kpb.GetKvLayoutRequest(), timeout=10).num_blocks
        wpb_grpc.WorkerServiceStub(channel).InitializeKvCache(
            wpb.InitializeKvCacheRequest(num_blocks=num_blocks), timeout=60)  # all zeros
        with pytest.raises(grpc.RpcError) as refused:
            list(kpb_grpc.KvTransferServiceStub(channel).PullBlocks(kpb.PullBlocksRequest(
                block_ids=params.remote_block_ids, epoch=params.remote_worker_epoch,
                lease_id=params.lease_id), timeout=10))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert [want[0], *decode(consumer, "after", want[0], params)] == want
    assert decode(consumer, "again", want[0], params) == want[1:]
    assert metric(pd, "pagoda_kv_transfer_blocks_total") == 0  # nothing was pulled
    assert wait_until(lambda: metric(pd, "pagoda_kv_transfer_failures_total",
                                     reason="stale_epoch") == 1, 15)
