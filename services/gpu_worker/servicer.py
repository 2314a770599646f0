"""The gpu-worker's RPCs over its executor (`make_executor`: the model runner in this
process, or a worker group whose rank 0 is this process); both also answer `reset`."""

from __future__ import annotations

import json
import logging
import threading
import time

import grpc

import pagoda.fault_injection as fault_injection
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as pb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as pb_grpc
from pagoda.executor.base import WorkerGroupFailed
from pagoda.worker.plan_checks import PlanLedger, PlanRejected, load_adapters
from pagoda.services.common.protocol.worker import (REJECTED_REQUEST_KEY, STEP_FAILED_KEY,
                                                   model_runner_output_to_proto,
                                                   scheduler_output_from_proto)
from pagoda.services.gpu_worker.metrics import worker_metrics
from pagoda.services.gpu_worker.step_thread import StepThread

logger = logging.getLogger(__name__)
# The worker methods a scheduler may call over gRPC (sleep mode): names only. A callable
# (`collective_rpc`'s other form) would be code chosen by whoever reaches this port.
SERVED_METHODS = ("sleep", "wake_up", "is_sleeping", "reload_weights")


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    """Invariant: steps run one at a time, in `step_id` order, on a KV cache that
    `InitializeKvCache` allocated; anything else is refused, never half-applied. A plan
    that does not fit what the worker holds (`ledger`, plan_checks.py) is refused
    INVALID_ARGUMENT before any of it runs; a step that fails midway leaves no request
    state behind, and the worker takes no step until the KV cache is set up again."""

    def __init__(self, runner, model: str, dtype: str, device: str,
                 ledger: PlanLedger | None = None, lora_config=None,
                 step_thread: StepThread | None = None) -> None:
        self.runner = runner
        self.info = pb.GetWorkerInfoResponse(model=model, dtype=dtype, device=device)
        self.ledger = ledger
        self.lora_config = lora_config  # --enable-lora's settings, None without
        self.step_lock = threading.Lock()
        # Every model call on one thread (see step_thread.py); None: the calling one.
        self.step_thread = step_thread
        self._next_step: int | None = None  # None until the KV cache exists
        # Called (under step_lock) when the KV cache's contents are lost: before it is
        # allocated again and when a step fails midway. The KV transport renews its
        # epoch there, so no transfer serves the zeroed blocks as the old ones.
        self.on_kv_lost = lambda: None

    def _on_step_thread(self, fn, *args):
        return fn(*args) if self.step_thread is None else self.step_thread.run(fn, *args)

    def GetWorkerInfo(self, request, context) -> pb.GetWorkerInfoResponse:
        return self.info

    def DetermineNumBlocks(self, request, context) -> pb.DetermineNumBlocksResponse:
        with self.step_lock:
            num_blocks = self._on_step_thread(self.runner.determine_num_blocks)
            return pb.DetermineNumBlocksResponse(num_blocks=num_blocks)

    def InitializeKvCache(self, request: pb.InitializeKvCacheRequest, context
                          ) -> pb.InitializeKvCacheResponse:
        if request.num_blocks < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_blocks must be at least 1")
        started = time.perf_counter()
        with self.step_lock:
            self.on_kv_lost()
            self._on_step_thread(self.runner.initialize_kv_cache, request.num_blocks)
            _forget_requests(self.runner)
            if self.ledger is not None:
                self.ledger.reset(request.num_blocks)
            self._next_step = 0
        logger.info("KV cache initialized: %d blocks in %.2f s", request.num_blocks,
                    time.perf_counter() - started)
        return pb.InitializeKvCacheResponse()

    def ExecuteModel(self, request: pb.ExecuteModelRequest, context: grpc.ServicerContext
                     ) -> pb.ExecuteModelResponse:
        with self.step_lock:
            if self._next_step is None or request.step_id != self._next_step:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"step {request.step_id} but expected {self._next_step}: "
                              "the scheduler must call InitializeKvCache first")
            plan = self._checked_plan(request, context)
            try:
                with worker_metrics().execute_model.time():
                    if fault_injection.check("worker.step") == "fail":
                        raise fault_injection.InjectedFault("injected fault: the step failed")
                    output = self._on_step_thread(self.runner.execute_model, plan)
            except WorkerGroupFailed as exc:  # a rank of a TP/PP group died: final
                context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            except Exception as exc:  # noqa: BLE001 - the state may be half-applied
                logger.exception("step %d failed; forgetting every request", request.step_id)
                self.on_kv_lost()
                _forget_requests(self.runner)
                if self.ledger is not None:
                    self.ledger.reset()
                self._next_step = None
                context.set_trailing_metadata(((STEP_FAILED_KEY, type(exc).__name__),))
                context.abort(grpc.StatusCode.INTERNAL,
                              f"the step failed ({type(exc).__name__}); the worker holds no "
                              "request now and waits for InitializeKvCache")
            if self.ledger is not None:
                self.ledger.record(plan, output)
            # One rank in this process (InProcessExecutor): its host KV tier's onloads.
            worker_metrics().observe_host_tier(
                getattr(getattr(self.runner, "runner", None), "host_tier", None))
            self._next_step += 1
        return pb.ExecuteModelResponse(model_runner_output=model_runner_output_to_proto(output))

    def CallWorkerMethod(self, request: pb.CallWorkerMethodRequest, context
                         ) -> pb.CallWorkerMethodResponse:
        """One of SERVED_METHODS on every rank, serialized with steps (the step lock and
        thread). `sleep` frees the KV cache, so the KV transport renews its epoch first:
        no block pulled later is taken for one cached before."""
        if request.method not in SERVED_METHODS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"worker method {request.method!r} is not served; one of "
                          f"{', '.join(SERVED_METHODS)}")
        try:
            raw = json.loads(request.arguments_json or "{}")
            args, kwargs = list(raw.get("args") or []), dict(raw.get("kwargs") or {})
        except (ValueError, TypeError, AttributeError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"arguments_json: {exc}")
        with self.step_lock:
            if request.method == "sleep":
                self.on_kv_lost()
            try:
                results = self._on_step_thread(self.runner.collective_rpc, request.method,
                                               tuple(args), kwargs)
            except (ValueError, TypeError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except (RuntimeError, NotImplementedError) as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        logger.info("worker method %s(%s) done", request.method, request.arguments_json)
        return pb.CallWorkerMethodResponse(results_json=json.dumps(results))

    def _checked_plan(self, request: pb.ExecuteModelRequest, context):
        """The step's plan, or the call ends INVALID_ARGUMENT (naming the request at
        fault in trailing metadata) with nothing applied."""
        try:
            plan = scheduler_output_from_proto(request.scheduler_output)
            if self.ledger is not None:
                self.ledger.check(plan)
            load_adapters(self.runner, self.lora_config, plan)
            return plan
        except PlanRejected as exc:
            if exc.request_id is not None:
                context.set_trailing_metadata(((REJECTED_REQUEST_KEY, exc.request_id),))
            message = f"request {exc.request_id}: {exc}" if exc.request_id else str(exc)
        except (ValueError, TypeError, KeyError) as exc:
            message = f"the plan is malformed: {exc}"
        logger.warning("step %d refused: %s", request.step_id, message)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _forget_requests(runner) -> None:
    """A (re)starting scheduler knows none of a previous one's requests: drop their
    batch state so a stale request can never shadow a new one with the same id."""
    runner.reset()
