"""The gpu-worker's `CallWorkerMethod` (sleep mode for a served replica), through the
scheduler's `GrpcWorkerExecutor.collective_rpc`: only the sleep-mode methods by name are
served (never a callable or another name: whoever reaches the port would choose the
code), refusals come back as the engine's errors, and sleep renews the KV epoch."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.engine.arg_utils import EngineArgs
from pagoda.executor.in_process import InProcessExecutor
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as wpb_grpc
from pagoda.services.gpu_worker.servicer import WorkerServicer
from pagoda.services.scheduler.worker_executor import GrpcWorkerExecutor


class Aborted(Exception):
    pass


class Context:
    def abort(self, code, details):
        raise Aborted(code, details)


@pytest.fixture(scope="module")
def servicer(tiny_llama_dir):
    config = EngineArgs(model=tiny_llama_dir, dtype="float32", max_model_len=64, block_size=16,
                        num_gpu_blocks_override=8, device="cpu").create_engine_config()
    executor = InProcessExecutor(config)
    executor.initialize_kv_cache(8)
    return WorkerServicer(executor, config.model, config.dtype, config.device)


def call(servicer, method: str, *args, **kwargs):
    request = wpb.CallWorkerMethodRequest(
        method=method, arguments_json=json.dumps({"args": list(args), "kwargs": kwargs}))
    return json.loads(servicer.CallWorkerMethod(request, Context()).results_json)


@pytest.mark.parametrize("method", ["apply_model", "callable:os:system", "get_model", "reset"])
def test_only_the_sleep_methods_are_served(servicer, method):
    with pytest.raises(Aborted) as refused:
        call(servicer, method, "x")
    assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert method in refused.value.args[1]


def test_sleep_and_wake_up_on_every_rank(servicer):
    renewed = []
    servicer.on_kv_lost = lambda: renewed.append(True)
    assert call(servicer, "is_sleeping") == [False]
    assert call(servicer, "sleep", 1) == [None]
    assert renewed == [True]  # no KV pull may serve the freed blocks as the old ones
    assert call(servicer, "is_sleeping") == [True]
    with pytest.raises(Aborted) as refused:  # the rank's own refusal, in its words
        call(servicer, "sleep", 1)
    assert refused.value.args[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert "already sleeping" in refused.value.args[1]
    with pytest.raises(Aborted) as refused:
        call(servicer, "wake_up", ["everything"])
    assert refused.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert call(servicer, "wake_up") == [None]
    assert call(servicer, "is_sleeping") == [False]


def test_grpc_executor_maps_the_worker_refusals(servicer):
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    wpb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        executor = GrpcWorkerExecutor(f"127.0.0.1:{port}", connect_timeout=30)
        assert executor.collective_rpc("is_sleeping") == [False]
        with pytest.raises(ValueError, match="not served"):
            executor.collective_rpc("apply_model", ("x",))
        with pytest.raises(TypeError):
            executor.collective_rpc(lambda worker: None)
        with pytest.raises(ValueError, match="unexpected"):  # bad arguments: the caller's
            executor.collective_rpc("reload_weights", (), {"unexpected": 1})
        assert executor.collective_rpc("sleep", (2,)) == [None]
        with pytest.raises(RuntimeError, match="already sleeping"):  # the rank's refusal
            executor.collective_rpc("sleep", (1,))
        with pytest.raises(RuntimeError, match="weights are asleep"):
            executor.collective_rpc("reload_weights")
        assert executor.collective_rpc("wake_up", (["weights"],)) == [None]
        assert executor.collective_rpc("reload_weights") == [None]
        assert executor.collective_rpc("wake_up") == [None]
        assert executor.collective_rpc("is_sleeping") == [False]
        executor.shutdown()
    finally:
        server.stop(None)
