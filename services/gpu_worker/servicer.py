"""The gpu-worker's RPCs over its executor (`make_executor`: the model runner in this
process, or a worker group whose rank 0 is this process); both also answer `reset`."""

from __future__ import annotations

import logging
import threading

import grpc

from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as pb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as pb_grpc
from pagoda.executor.base import WorkerGroupFailed
from pagoda.services.common.protocol.worker import model_runner_output_to_proto, scheduler_output_from_proto
from pagoda.services.gpu_worker.metrics import worker_metrics

logger = logging.getLogger(__name__)


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """Invariant: steps run one at a time, in `step_id` order, on a KV cache that
    `InitializeKvCache` allocated; anything else is refused, never half-applied."""

    def __init__(self, runner, model: str, dtype: str, device: str) -> None:
        self.runner = runner
        self.info = pb.GetWorkerInfoResponse(model=model, dtype=dtype, device=device)
        self._lock = threading.Lock()
        self._next_step: int | None = None  # None until the KV cache exists

    def GetWorkerInfo(self, request, context) -> pb.GetWorkerInfoResponse:
        return self.info

    def DetermineNumBlocks(self, request, context) -> pb.DetermineNumBlocksResponse:
        with self._lock:
            return pb.DetermineNumBlocksResponse(num_blocks=self.runner.determine_num_blocks())

    def InitializeKvCache(self, request: pb.InitializeKvCacheRequest, context
                          ) -> pb.InitializeKvCacheResponse:
        with self._lock:
            self.runner.initialize_kv_cache(request.num_blocks)
            _forget_requests(self.runner)
            self._next_step = 0
        logger.info("KV cache initialized: %d blocks", request.num_blocks)
        return pb.InitializeKvCacheResponse()

    def ExecuteModel(self, request: pb.ExecuteModelRequest, context: grpc.ServicerContext
                     ) -> pb.ExecuteModelResponse:
        with self._lock:
            if self._next_step is None or request.step_id != self._next_step:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"step {request.step_id} but expected {self._next_step}: "
                              "the scheduler must call InitializeKvCache first")
            plan = scheduler_output_from_proto(request.scheduler_output)
            try:
                with worker_metrics().execute_model.time():
                    output = self.runner.execute_model(plan)
            except WorkerGroupFailed as exc:  # a rank of a TP/PP group died: final
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            self._next_step += 1
        return pb.ExecuteModelResponse(model_runner_output=model_runner_output_to_proto(output))


def _forget_requests(runner) -> None:
    """A (re)starting scheduler knows none of a previous one's requests: drop their
    batch state so a stale request can never shadow a new one with the same id."""
    runner.reset()
