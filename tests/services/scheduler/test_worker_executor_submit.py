"""`GrpcWorkerExecutor.submit_step` (async scheduling): a step sent ahead goes out while
the one before it still runs, and a step's failure reaches its future as the same
error `execute_model` raises (StepRejected, StepFailed, WorkerUnavailable)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagoda.executor.base import StepFailed, StepRejected
from pagoda.messages import ModelRunnerOutput, SchedulerOutput
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as wpb_grpc
from pagoda.services.common.protocol.worker import (REJECTED_REQUEST_KEY, STEP_FAILED_KEY,
                                                   model_runner_output_to_proto)
from pagoda.services.scheduler.worker_executor import GrpcWorkerExecutor, WorkerUnavailable


class Worker(wpb_grpc.WorkerServiceServicer):
    """Step 0 ends only once step 1 has arrived (as on a worker whose step N+1 came
    while N ran); step 2 is refused for request "bad", step 3 fails midway."""

    def __init__(self) -> None:
        self.second_arrived = threading.Event()

    def GetWorkerInfo(self, request, context):
        return wpb.GetWorkerInfoResponse(model="m", reads_plan_columns=True)

    def InitializeKvCache(self, request, context):
        return wpb.InitializeKvCacheResponse()

    def ExecuteModel(self, request, context):
        if request.step_id == 0:
            assert self.second_arrived.wait(10), "step 1 was not sent while step 0 ran"
        elif request.step_id == 1:
            self.second_arrived.set()
        elif request.step_id == 2:
            context.set_trailing_metadata(((REJECTED_REQUEST_KEY, "bad"),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no such block")
        elif request.step_id == 3:
            context.set_trailing_metadata(((STEP_FAILED_KEY, "1"),))
            context.abort(grpc.StatusCode.INTERNAL, "the step failed midway")
        out = ModelRunnerOutput(["r"], [[int(request.step_id)]])
        return wpb.ExecuteModelResponse(model_runner_output=model_runner_output_to_proto(
            out, columns=request.scheduler_output.reply_columns))


@pytest.fixture
def executor():
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    wpb_grpc.add_WorkerServiceServicer_to_server(Worker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    executor = GrpcWorkerExecutor(f"127.0.0.1:{port}", connect_timeout=30)
    executor.initialize_kv_cache(4)
    yield executor, server
    executor.shutdown()
    server.stop(None)


def test_a_step_sent_ahead_goes_out_while_the_one_before_runs(executor):
    executor, _ = executor
    first, second = executor.submit_step(SchedulerOutput.empty()), \
        executor.submit_step(SchedulerOutput.empty())
    assert first.result(timeout=30).sampled_token_ids == [[0]]
    assert second.result(timeout=30).sampled_token_ids == [[1]]
    with pytest.raises(StepRejected) as refused:
        executor.submit_step(SchedulerOutput.empty()).result(timeout=30)
    assert refused.value.request_id == "bad"
    with pytest.raises(StepFailed):
        executor.submit_step(SchedulerOutput.empty()).result(timeout=30)


def test_a_worker_gone_fails_the_step_as_unavailable(executor):
    executor, server = executor
    server.stop(None)
    with pytest.raises(WorkerUnavailable):
        executor.submit_step(SchedulerOutput.empty()).result(timeout=30)
