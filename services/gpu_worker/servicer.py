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

    # A waiting step re-checks its turn this often, as a safety net only: every change
    # of `_next_queued` or `_epoch` notifies the waiters.
    TURN_POLL_S = 0.5

    def __init__(self, runner, model: str, dtype: str, device: str,
                 ledger: PlanLedger | None = None, lora_config=None,
                 step_thread: StepThread | None = None) -> None:
        self.runner = runner
        # reads_plan_columns: this version reads a plan's block columns (worker.py).
        self.info = pb.GetWorkerInfoResponse(model=model, dtype=dtype, device=device,
                                             reads_plan_columns=True)
        self.ledger = ledger
        self.lora_config = lora_config  # --enable-lora's settings, None without
        self.step_lock = threading.Lock()
        # Every model call on one thread (see step_thread.py); None: the calling one.
        self.step_thread = step_thread
        self._next_step: int | None = None  # None until the KV cache exists
        # Async scheduling sends step N+1 while N runs: it waits here for its turn, so
        # it starts the moment N ends. A refused step K refuses those queued behind it
        # (`_refuse_from` = K + 1) until K runs or the KV cache is set up again; a new
        # KV cache (or a failed step) ends every wait (`_epoch`).
        self._turn = threading.Condition(threading.Lock())
        self._next_queued = 0  # the step id the step thread takes next (under _turn)
        self._refuse_from: int | None = None
        self._epoch = 0
        # Called (under step_lock) when the KV cache's contents are lost: before it is
        # allocated again and when a step fails midway. The KV transport renews its
        # epoch there, so no transfer serves the zeroed blocks as the old ones.
        self.on_kv_lost = lambda: None

    def _on_step_thread(self, fn, *args):
        return fn(*args) if self.step_thread is None else self.step_thread.run(fn, *args)

    def _locked_on_step_thread(self, fn, *args):
        """fn(*args) under step_lock, taken on the step thread: the lock is only ever
        held there (and by the KV transport), so a step queued ahead on the step thread
        can never wait for a lock whose holder waits for the step thread."""
        def locked():
            with self.step_lock:
                return fn(*args)
        return self._on_step_thread(locked)

    def GetWorkerInfo(self, request, context) -> pb.GetWorkerInfoResponse:
        return self.info

    def DetermineNumBlocks(self, request, context) -> pb.DetermineNumBlocksResponse:
        num_blocks = self._locked_on_step_thread(self.runner.determine_num_blocks)
        return pb.DetermineNumBlocksResponse(num_blocks=num_blocks)

    def InitializeKvCache(self, request: pb.InitializeKvCacheRequest, context
                          ) -> pb.InitializeKvCacheResponse:
        if request.num_blocks < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_blocks must be at least 1")
        started = time.perf_counter()
        self._locked_on_step_thread(self._initialize_kv_cache, request.num_blocks)
        logger.info("KV cache initialized: %d blocks in %.2f s", request.num_blocks,
                    time.perf_counter() - started)
        return pb.InitializeKvCacheResponse()

    def _initialize_kv_cache(self, num_blocks: int) -> None:
        self.on_kv_lost()
        self.runner.initialize_kv_cache(num_blocks)
        _forget_requests(self.runner)
        if self.ledger is not None:
            self.ledger.reset(num_blocks)
        self._next_step = 0
        self._refuse_from = None
        with self._turn:
            self._epoch += 1
            self._next_queued = 0
            self._turn.notify_all()

    def ExecuteModel(self, request: pb.ExecuteModelRequest, context: grpc.ServicerContext
                     ) -> pb.ExecuteModelResponse:
        """Steps are queued on the step thread in `step_id` order: a step sent ahead
        (async scheduling) waits here until the one before it is queued, then runs on
        the step thread right after it, with no thread switch between them."""
        epoch = self._epoch
        # Decoded before its turn: a step sent ahead is ready the moment it comes.
        try:
            plan = scheduler_output_from_proto(request.scheduler_output)
        except (ValueError, TypeError, KeyError) as exc:
            plan = exc
        step_id = request.step_id
        with self._turn:
            # Only the step right behind the last one queued may wait (async sends one
            # ahead); any other out-of-order step is refused at once (_run_step).
            while (step_id == self._next_queued + 1 and epoch == self._epoch
                   and self._next_step is not None and context.is_active()
                   and (self._refuse_from is None or step_id < self._refuse_from)):
                self._turn.wait(self.TURN_POLL_S)
            if epoch == self._epoch and step_id == self._next_queued:
                self._next_queued += 1
                # Wake the step sent ahead, if it already waits: without this it slept
                # out TURN_POLL_S (up to 0.5 s a step) whenever it came in first.
                self._turn.notify_all()
            if self.step_thread is None:
                future = None
            else:
                future = self.step_thread.submit(self._step, step_id, plan, epoch)
        result = (self._step(step_id, plan, epoch) if future is None else future.result())
        if isinstance(result, _Refusal):
            if result.metadata:
                context.set_trailing_metadata(result.metadata)
            context.abort(result.code, result.message)
        # Columns only for a scheduler that asked for them: an older one reads none.
        return pb.ExecuteModelResponse(model_runner_output=model_runner_output_to_proto(
            result, columns=request.scheduler_output.reply_columns))

    def _step(self, step_id: int, plan, epoch: int):
        """One step on the step thread, under step_lock: its output, or a _Refusal."""
        with self.step_lock:
            try:
                return self._run_step(step_id, plan, epoch)
            except _Refusal as refusal:
                return refusal

    def _run_step(self, step_id: int, plan, epoch: int):
        if self._refuse_from is not None and step_id >= self._refuse_from:
            raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                           f"step {step_id} follows a refused step")
        if epoch != self._epoch or self._next_step is None or step_id != self._next_step:
            raise _Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                           f"step {step_id} but expected {self._next_step}: "
                           "the scheduler must call InitializeKvCache first")
        plan = self._checked_plan(step_id, plan)
        try:
            with worker_metrics().execute_model.time():
                if fault_injection.check("worker.step") == "fail":
                    raise fault_injection.InjectedFault("injected fault: the step failed")
                output = self.runner.execute_model(plan)
        except WorkerGroupFailed as exc:  # a rank of a TP/PP group died: final
            raise _Refusal(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the state may be half-applied
            logger.exception("step %d failed; forgetting every request", step_id)
            self.on_kv_lost()
            _forget_requests(self.runner)
            if self.ledger is not None:
                self.ledger.reset()
            self._next_step = None
            with self._turn:
                self._epoch += 1
                self._turn.notify_all()
            raise _Refusal(grpc.StatusCode.INTERNAL,
                           f"the step failed ({type(exc).__name__}); the worker holds no "
                           "request now and waits for InitializeKvCache",
                           ((STEP_FAILED_KEY, type(exc).__name__),)) from None
        if self.ledger is not None:
            self.ledger.record(plan, output)
        # One rank in this process (InProcessExecutor): its host KV tier's onloads.
        worker_metrics().observe_host_tier(
            getattr(getattr(self.runner, "runner", None), "host_tier", None))
        self._next_step += 1
        self._refuse_from = None
        return output

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
        def call():
            if request.method == "sleep":
                self.on_kv_lost()
            return self.runner.collective_rpc(request.method, tuple(args), kwargs)

        try:
            results = self._locked_on_step_thread(call)
        except (ValueError, TypeError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (RuntimeError, NotImplementedError) as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        logger.info("worker method %s(%s) done", request.method, request.arguments_json)
        return pb.CallWorkerMethodResponse(results_json=json.dumps(results))

    def _checked_plan(self, step_id: int, plan):
        """The step's plan (decoded, or the exception decoding raised), or a _Refusal
        (INVALID_ARGUMENT, naming the request at fault in trailing metadata) with
        nothing applied. The steps queued behind a refused one are refused too."""
        metadata = ()
        try:
            if isinstance(plan, Exception):
                raise plan
            if self.ledger is not None:
                self.ledger.check(plan)
            load_adapters(self.runner, self.lora_config, plan)
            return plan
        except PlanRejected as exc:
            if exc.request_id is not None:
                metadata = ((REJECTED_REQUEST_KEY, exc.request_id),)
            message = f"request {exc.request_id}: {exc}" if exc.request_id else str(exc)
        except (ValueError, TypeError, KeyError) as exc:
            message = f"the plan is malformed: {exc}"
        logger.warning("step %d refused: %s", step_id, message)
        self._refuse_from = step_id + 1
        with self._turn:  # the scheduler sends this step id again (or resets)
            self._next_queued = min(self._next_queued, step_id)
            self._turn.notify_all()
        raise _Refusal(grpc.StatusCode.INVALID_ARGUMENT, message, metadata)


class _Refusal(Exception):
    """How a step ends when it does not run: the gRPC status its call ends with."""

    def __init__(self, code: grpc.StatusCode, message: str, metadata: tuple = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.metadata = code, message, metadata


def _forget_requests(runner) -> None:
    """A (re)starting scheduler knows none of a previous one's requests: drop their
    batch state so a stale request can never shadow a new one with the same id."""
    runner.reset()
