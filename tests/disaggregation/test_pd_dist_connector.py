"""PagodaDistConnector (a torch.distributed pair group between the two gpu-workers;
gloo here, NCCL on CUDA) into a decode replica split differently from its prefill
replica (TP=1 -> TP=2: blocks travel whole, each decode rank writes its share):
greedy outputs equal a colocated single-rank cluster's, and the failures are defined
outcomes with real processes: a stale epoch is refused, and a source worker killed
for real fails the pull at once (no wait on the dead pair) and the request is then
served by local prefill. (A group's export is tests/executor/test_kv_blocks_group.py.)"""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from pd_cluster import PREFILL_HEADER, role_address, role_process, start_pd
from serve_cluster import ServeProcess, flag_value, wait_until

from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2 as kpb
from pagoda.services._proto.pagoda.kv_transfer.v1 import kv_transfer_pb2_grpc as kpb_grpc

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # make test-extended
LONG = " ".join(f"word{i}" for i in range(120))  # ~ 250 tokens: many 16-token blocks
PROMPTS = [("Hello there", 10), (LONG, 8), (LONG + " and then", 8)]
DIST = ["--kv-connector", "PagodaDistConnector", "--decode-tensor-parallel-size", "2",
        "--distributed-executor-backend", "mp"]


def complete(serve: ServeProcess, prompt: str, max_tokens: int) -> httpx.Response:
    reply = httpx.post(f"{serve.url}/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert reply.status_code == 200, reply.text
    return reply


def metric(serve, name: str, **labels) -> float:
    return sum(v for (n, ls), v in serve.scrape().items()
               if n == name and all((k, val) in ls for k, val in labels.items()))


def worker_address(serve: ServeProcess, role: str) -> str:
    return f"127.0.0.1:{flag_value(role_process(serve, 'gpu-worker', role).cmdline(), '--port')}"


def layout(address: str) -> kpb.KvLayout:
    with grpc.insecure_channel(address) as channel:
        return kpb_grpc.KvTransferServiceStub(channel).GetKvLayout(kpb.GetKvLayoutRequest(),
                                                                   timeout=10)


@pytest.fixture(scope="module")
def colocated_texts(plain_tiny_cluster) -> list[str]:
    """What the session's plain tiny cluster (pd_cluster.BASE's flags, one replica) says."""
    return [complete(plain_tiny_cluster, p, n).json()["choices"][0]["text"] for p, n in PROMPTS]


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, redis_server):
    serve = start_pd(tiny_llama_dir, redis_server.url, *DIST)
    yield serve
    serve.stop()


def test_the_connector_and_each_pools_split_are_on_the_command_lines(pd):
    for kind in ("scheduler", "gpu-worker"):
        for role, tp in (("kv_producer", 1), ("kv_consumer", 2)):
            cmd = role_process(pd, kind, role).cmdline()
            assert '"kv_connector":"PagodaDistConnector"' in flag_value(cmd,
                                                                         "--kv-transfer-config")
            assert tensor_parallel_size(cmd) == tp


def tensor_parallel_size(cmd: list[str]) -> int:
    """The value argparse keeps: the flag's last occurrence (1 when absent)."""
    if "--tensor-parallel-size" not in cmd:
        return 1
    return int(cmd[len(cmd) - cmd[::-1].index("--tensor-parallel-size")])


def test_greedy_outputs_equal_colocated_and_blocks_move_on_the_pair(pd, colocated_texts):
    before = metric(pd, "pagoda_kv_transfer_blocks_total")
    replies = [complete(pd, p, n) for p, n in PROMPTS]
    assert [r.json()["choices"][0]["text"] for r in replies] == colocated_texts
    assert all(PREFILL_HEADER in r.headers for r in replies)
    assert wait_until(lambda: metric(pd, "pagoda_kv_transfer_blocks_total") - before >= 15, 10)
    assert metric(pd, "pagoda_kv_transfer_failures_total") == 0


def test_a_stale_epoch_is_refused(pd):
    decode = worker_address(pd, "kv_consumer")
    prefill = worker_address(pd, "kv_producer")
    with grpc.insecure_channel(decode) as channel:
        with pytest.raises(grpc.RpcError) as error:
            kpb_grpc.KvTransferServiceStub(channel).FetchBlocks(kpb.FetchBlocksRequest(
                source_address=prefill, source_epoch="an-old-incarnation",
                remote_block_ids=[0], local_block_ids=[1], timeout_s=5), timeout=30)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_killed_source_fails_the_pull_at_once_then_local_prefill(pd, colocated_texts):
    complete(pd, *PROMPTS[1])  # the pair with the prefill worker exists
    decode = worker_address(pd, "kv_consumer")
    prefill = worker_address(pd, "kv_producer")
    epoch = layout(prefill).epoch
    role_process(pd, "gpu-worker", "kv_producer").kill()
    started = time.monotonic()
    with grpc.insecure_channel(decode) as channel:
        with pytest.raises(grpc.RpcError) as error:
            kpb_grpc.KvTransferServiceStub(channel).FetchBlocks(kpb.FetchBlocksRequest(
                source_address=prefill, source_epoch=epoch, remote_block_ids=[0, 1],
                local_block_ids=[1, 2], timeout_s=20), timeout=60)
    assert error.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED)
    assert time.monotonic() - started < 15  # well within the pull's own 20 s limit
    # The client never sees the dead prefill worker: the decode replica prefills.
    reply = complete(pd, *PROMPTS[2])
    assert reply.json()["choices"][0]["text"] == colocated_texts[2]
    assert role_address(pd, "scheduler", "kv_consumer") == reply.headers["x-pagoda-instance"]
