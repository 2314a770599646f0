"""The scheduler service over a real gpu-worker servicer (tiny random Llama, CPU).

The same requests, driven through the scheduler's gRPC `Generate` streams and a
worker reached over gRPC, give exactly the tokens the in-process engine gives.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2 as spb
from pagoda.services._proto.pagoda.scheduler.v1 import scheduler_pb2_grpc as spb_grpc
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as wpb_grpc
from pagoda.engine.arg_utils import EngineArgs
from pagoda.messages import EngineCoreRequest, FinishReason
from pagoda.engine.engine_core import EngineCore
from pagoda.executor.in_process import InProcessExecutor
from pagoda.services.common.protocol.scheduler import request_to_proto, response_to_output
from pagoda.sampling_params import SamplingParams
from pagoda.services.common.grpc_server import STREAM_READER_OPTIONS
from pagoda.services.gpu_worker.servicer import WorkerServicer
from pagoda.services.scheduler.engine_loop import EngineLoop
from pagoda.services.scheduler.servicer import SchedulerServicer
from pagoda.services.scheduler.worker_executor import GrpcWorkerExecutor

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [100, 200, 300],
           [42] * 40]


def engine_config(model_dir):
    return EngineArgs(model=model_dir, dtype="float32", max_model_len=256, block_size=16,
                      num_gpu_blocks_override=64, device="cpu").create_engine_config()


def requests(max_tokens=12):
    return [EngineCoreRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                         ignore_eos=True), arrival_time=0.0)
            for i, p in enumerate(PROMPTS)]


def offline_tokens(model_dir) -> dict[str, list[int]]:
    config = engine_config(model_dir)
    core = EngineCore(config, InProcessExecutor(config))
    for req in requests():
        core.add_request(req)
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture
def worker(tiny_llama_dir):
    """A gpu-worker servicer on a free port, over the executor the gpu-worker builds
    for one rank; yields (address, grpc server)."""
    config = engine_config(tiny_llama_dir)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    wpb_grpc.add_WorkerServiceServicer_to_server(
        WorkerServicer(InProcessExecutor(config), config.model, config.dtype, config.device), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", server
    server.stop(None)


class SchedulerHarness:
    """The scheduler servicer on a grpc.aio server in a background event loop."""

    def __init__(self, config, worker_addr: str) -> None:
        self.core = EngineCore(config, GrpcWorkerExecutor(worker_addr, connect_timeout=30))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servicer = None
        self.engine = EngineLoop(self.core, lambda o: self.servicer.on_outputs(o), lambda e: None,
                                 lambda exc: self.servicer.on_failure(exc))
        info = spb.GetModelInfoResponse(model="tiny", max_model_len=256, block_size=16)
        self.servicer = SchedulerServicer(self.engine, info, [2])
        self.servicer.bind_loop(self.loop)
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        self.engine.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = spb_grpc.SchedulerServiceStub(self.channel)

    async def _start(self) -> int:
        self.server = grpc.aio.server()
        spb_grpc.add_SchedulerServiceServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result()
        self.engine.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def scheduler(tiny_llama_dir, worker):
    harness = SchedulerHarness(engine_config(tiny_llama_dir), worker[0])
    yield harness
    harness.close()


def collect(stub, req: EngineCoreRequest):
    tokens, finish = [], None
    for msg in stub.Generate(request_to_proto(req), timeout=60):
        out = response_to_output(req.request_id, msg)
        tokens.extend(out.new_token_ids)
        if out.finished:
            finish = out.finish_reason
    return tokens, finish


def test_service_chain_gives_the_offline_engine_tokens(tiny_llama_dir, scheduler):
    expected = offline_tokens(tiny_llama_dir)
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = dict(zip([r.request_id for r in requests()],
                           pool.map(lambda r: collect(scheduler.stub, r), requests())))
    for rid, (tokens, finish) in results.items():
        assert tokens == expected[rid]
        assert len(tokens) == 12 and finish == FinishReason.LENGTH


def test_invalid_request_is_rejected_with_invalid_argument(scheduler):
    too_long = EngineCoreRequest("long", list(range(300)), SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as info:
        collect(scheduler.stub, too_long)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum model length" in info.value.details()
    # The replica still serves good requests afterwards.
    assert len(collect(scheduler.stub, requests(max_tokens=3)[0])[0]) == 3


def test_cancelled_stream_aborts_and_frees_blocks(scheduler):
    req = EngineCoreRequest("c", PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True))
    call = scheduler.stub.Generate(request_to_proto(req))
    next(call)  # the request is running
    call.cancel()
    for _ in range(100):
        stats = scheduler.engine.stats
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks:
            break
        threading.Event().wait(0.05)
    assert scheduler.engine.stats.num_running == 0
    assert scheduler.engine.stats.num_free_blocks == scheduler.engine.stats.num_blocks


def test_dead_worker_fails_requests_instead_of_hanging(scheduler, worker):
    req = EngineCoreRequest("d", PROMPTS[0], SamplingParams(max_tokens=10_000 // 100,
                                                             ignore_eos=True))
    call = scheduler.stub.Generate(request_to_proto(req), timeout=60)
    next(call)
    worker[1].stop(None)  # the worker goes away mid-request
    with pytest.raises(grpc.RpcError) as info:
        for _ in call:
            pass
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as info:  # and later requests are refused at once
        collect(scheduler.stub, requests(max_tokens=2)[1])
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    load = scheduler.stub.GetLoad(spb.GetLoadRequest())
    assert not load.serving


def test_worker_refuses_out_of_order_steps(worker):
    with grpc.insecure_channel(worker[0]) as channel:
        stub = wpb_grpc.WorkerServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.ExecuteModel(wpb.ExecuteModelRequest(step_id=0))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stub.InitializeKvCache(wpb.InitializeKvCacheRequest(num_blocks=8))
        with pytest.raises(grpc.RpcError) as info:
            stub.ExecuteModel(wpb.ExecuteModelRequest(step_id=3))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_reader_that_falls_behind_gets_coalesced_chunks(scheduler):
    channel = grpc.insecure_channel(f"127.0.0.1:{scheduler.port}", options=STREAM_READER_OPTIONS)
    stub = spb_grpc.SchedulerServiceStub(channel)
    req = EngineCoreRequest("slow-reader", PROMPTS[1], SamplingParams(max_tokens=150,
                                                                      ignore_eos=True))
    call = stub.Generate(request_to_proto(req), timeout=60)
    sizes = [len(next(call).chunk.token_ids)]
    threading.Event().wait(2.0)  # the reader stalls while the engine keeps generating
    sizes += [len(m.chunk.token_ids) for m in call if m.HasField("chunk")]
    channel.close()
    assert sum(sizes) == 150
    assert len(sizes) < 75 and max(sizes) > 10  # a backlog arrived as a few large chunks
