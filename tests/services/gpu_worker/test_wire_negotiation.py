"""Schedulers and gpu-workers upgrade separately (the chart deploys them apart), so the
int columns of the plan (new blocks) and of the reply (sampled tokens) are negotiated:
a worker replies in columns only to a plan that asks (`reply_columns`), a scheduler
sends block columns only to a worker that says it reads them (`reads_plan_columns`).
Each side otherwise sends the message per request that an older peer reads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc

from pagoda.messages import CachedRequestData, ModelRunnerOutput, SchedulerOutput
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as wpb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as wpb_grpc
from pagoda.services.common.protocol.worker import scheduler_output_to_proto
from pagoda.services.gpu_worker.servicer import WorkerServicer
from pagoda.services.scheduler.worker_executor import GrpcWorkerExecutor


class EchoRunner:
    """Samples, for each cached request, the blocks its plan gave it (plus its index):
    the reply then shows both what the worker read and how it wrote it."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        pass

    def reset(self) -> None:
        pass

    def execute_model(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        cached = plan.scheduled_cached_reqs
        return ModelRunnerOutput(req_ids=list(cached.req_ids),
                                 sampled_token_ids=[[i, *blocks] for i, blocks
                                                    in enumerate(cached.new_block_ids)])


class Context:
    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise AssertionError(f"refused: {code} {details}")


PLAN = SchedulerOutput([], CachedRequestData(["a", "b", "c"], [[7], [], [8, 9]], [3, 4, 5]),
                       {"a": 1, "b": 1, "c": 1}, 3)
SAMPLED = [[0, 7], [1], [2, 8, 9]]


def older_reader(reply: wpb.ModelRunnerOutput) -> list[list[int]]:
    """What a scheduler from before the columns reads: the message per request only."""
    return [t.token_ids[:] for t in reply.sampled_token_ids]


def test_an_older_schedulers_plan_gets_the_reply_it_reads_and_a_newer_one_columns():
    worker = WorkerServicer(EchoRunner(), "m", "float32", "cpu")
    worker.InitializeKvCache(wpb.InitializeKvCacheRequest(num_blocks=8), Context())
    older_plan = scheduler_output_to_proto(PLAN, block_columns=False)
    older_plan.ClearField("reply_columns")  # an older scheduler knows no such field
    reply = worker.ExecuteModel(wpb.ExecuteModelRequest(step_id=0, scheduler_output=older_plan),
                                Context()).model_runner_output
    assert older_reader(reply) == SAMPLED
    assert not reply.sampled_token_counts and not reply.sampled_token_flat

    newer_plan = scheduler_output_to_proto(PLAN, block_columns=True)
    reply = worker.ExecuteModel(wpb.ExecuteModelRequest(step_id=1, scheduler_output=newer_plan),
                                Context()).model_runner_output
    assert not reply.sampled_token_ids  # no message per request
    assert list(reply.sampled_token_counts) == [2, 1, 3]
    assert list(reply.sampled_token_flat) == [0, 7, 1, 2, 8, 9]


def test_the_scheduler_sends_block_columns_only_to_a_worker_that_reads_them():
    for reads_columns in (True, False):
        worker = WorkerServicer(EchoRunner(), "m", "float32", "cpu")
        worker.info.reads_plan_columns = reads_columns  # False: as an older worker says
        seen: list[wpb.SchedulerOutput] = []
        execute = worker.ExecuteModel

        def recording(request, context, execute=execute, seen=seen):
            seen.append(wpb.SchedulerOutput.FromString(
                request.scheduler_output.SerializeToString()))
            return execute(request, context)

        worker.ExecuteModel = recording
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        wpb_grpc.add_WorkerServiceServicer_to_server(worker, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            executor = GrpcWorkerExecutor(f"127.0.0.1:{port}", connect_timeout=30)
            executor.initialize_kv_cache(8)
            assert executor.execute_model(PLAN).sampled_token_ids == SAMPLED
            assert executor.submit_step(PLAN).result(timeout=30).sampled_token_ids == SAMPLED
        finally:
            server.stop(None)
        for plan in seen:
            assert plan.reply_columns
            cached = plan.scheduled_cached_reqs
            if reads_columns:
                assert not cached.new_block_ids and list(cached.new_block_counts) == [1, 0, 2]
            else:  # exactly what an older worker reads
                assert [b.block_ids[:] for b in cached.new_block_ids] == [[7], [], [8, 9]]
                assert not cached.new_block_counts and not cached.new_block_flat
