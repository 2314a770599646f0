"""`GrpcWorkerExecutor`: the engine core's executor, backed by a gpu-worker service.

One unary `ExecuteModel` call per engine step carries that step's plan of diffs.
Block allocation stays in the scheduler; the worker only runs the plan.

A worker that stops answering fails the step, and so the replica (WorkerUnavailable:
the engine loop fails and the scheduler ends its streams for migration), in one of two
ways: a frozen process misses the channel's keepalive pings (~10 s, grpc_channels.py);
a process that still answers pings but never finishes the step (a hung kernel or
collective) runs into the step's deadline (`--execute-model-timeout`, default 300 s).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time

import grpc

from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as pb
from pagoda.services._proto.pagoda.worker.v1 import worker_pb2_grpc as pb_grpc
from pagoda.messages import ModelRunnerOutput, SchedulerOutput
from pagoda.executor.base import Executor, StepFailed, StepRejected
from pagoda.services.common.protocol.worker import (REJECTED_REQUEST_KEY, STEP_FAILED_KEY,
                                                   model_runner_output_from_proto,
                                                   scheduler_output_to_proto)
from pagoda.services.common import grpc_channels
from pagoda.services.common.tracing import intercept
from pagoda.services.scheduler.tracing import step_span

logger = logging.getLogger(__name__)


class WorkerUnavailable(RuntimeError):
    """The worker failed or went away; the replica cannot continue."""


class GrpcWorkerExecutor(Executor):
    """Invariant: `step_id` counts the ExecuteModel calls since InitializeKvCache, and
    the worker rejects any other, so scheduler and worker never drift apart."""

    def __init__(self, address: str, connect_timeout: float = 600.0,
                 step_timeout: float | None = 600.0) -> None:
        self.address = address
        self.step_timeout = step_timeout
        self._channel = grpc_channels.channel(address)
        self._stub = pb_grpc.WorkerServiceStub(intercept(self._channel))
        self._step_id = 0
        # Whether the worker reads the plan's block columns (an older one does not).
        self._block_columns = False
        self._wait_until_ready(connect_timeout)

    def _wait_until_ready(self, timeout: float) -> None:
        """The worker may still be loading its weights: wait for it, logging now and then."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                info = self._stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=5.0,
                                                wait_for_ready=True)
                self._block_columns = info.reads_plan_columns
                logger.info("gpu-worker at %s: %s (%s on %s)", self.address, info.model,
                            info.dtype, info.device)
                return
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    raise WorkerUnavailable(f"gpu-worker at {self.address} is not reachable: "
                                            f"{exc.code().name}") from exc
                logger.info("waiting for the gpu-worker at %s", self.address)

    def determine_num_blocks(self) -> int:
        return self._call("DetermineNumBlocks", pb.DetermineNumBlocksRequest()).num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call("InitializeKvCache", pb.InitializeKvCacheRequest(num_blocks=num_blocks))
        self._step_id = 0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step. StepRejected when the worker refused the plan because of one
        request (nothing ran; the step id stays); StepFailed when it failed midway and
        waits for `initialize_kv_cache`; WorkerUnavailable otherwise, also for
        a step past `step_timeout` or a worker lost to keepalive."""
        request = pb.ExecuteModelRequest(step_id=self._step_id,
                                         scheduler_output=scheduler_output_to_proto(
                                             scheduler_output, self._block_columns))
        with step_span(scheduler_output, self._step_id):
            try:
                reply = self._stub.ExecuteModel(request, timeout=self.step_timeout)
            except grpc.RpcError as exc:
                culprit = _rejected_request(exc)
                if culprit is not None:
                    raise StepRejected(f"the worker refused it: {exc.details()}",
                                       culprit) from None
                if _step_failed(exc):  # the worker is alive and waits for InitializeKvCache
                    raise StepFailed(f"gpu-worker at {self.address}: {exc.details()}") from None
                raise WorkerUnavailable(f"gpu-worker at {self.address} failed in ExecuteModel:"
                                        f" {exc.code().name}: {exc.details()}") from exc
        self._step_id += 1
        return model_runner_output_from_proto(reply.model_runner_output)

    def submit_step(self, scheduler_output: SchedulerOutput) -> concurrent.futures.Future:
        """Async scheduling: send the step now, without waiting for the steps before it
        (the worker runs steps in `step_id` order, a step sent ahead waiting for its
        turn there); a future of its output, or of the error `execute_model` raises.
        After any failed step the engine sets the KV cache up again (which restarts the
        step ids) before it sends another."""
        request = pb.ExecuteModelRequest(step_id=self._step_id,
                                         scheduler_output=scheduler_output_to_proto(
                                             scheduler_output, self._block_columns))
        self._step_id += 1
        result: concurrent.futures.Future = concurrent.futures.Future()
        # A .future(), not blocking calls on sender threads: those took ~0.25 ms a step
        # off the engine thread but cost the process as much in their wake-ups (served,
        # 15 ms steps, 256 streams: 3.9 ms of scheduler CPU per step either way).
        # Nor one long-lived stream: benchmarks/bench_execute_model_rpc.py measured a
        # bidi call at ~10% less client CPU than this call (~0.03 ms a step), an aio
        # stream on the event loop at more; neither worth a second failure path.
        call = self._stub.ExecuteModel.future(request, timeout=self.step_timeout)

        def done(call) -> None:
            try:
                reply = call.result()
            except grpc.RpcError as exc:
                result.set_exception(self._step_error(exc))
            except Exception as exc:  # noqa: BLE001 - cancelled at shutdown
                result.set_exception(WorkerUnavailable(f"gpu-worker at {self.address}: {exc}"))
            else:
                result.set_result(model_runner_output_from_proto(reply.model_runner_output))

        call.add_done_callback(done)
        return result

    def _step_error(self, exc: grpc.RpcError) -> Exception:
        culprit = _rejected_request(exc)
        if culprit is not None:
            return StepRejected(f"the worker refused it: {exc.details()}", culprit)
        if _step_failed(exc):
            return StepFailed(f"gpu-worker at {self.address}: {exc.details()}")
        return WorkerUnavailable(f"gpu-worker at {self.address} failed in ExecuteModel:"
                                 f" {exc.code().name}: {exc.details()}")

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """A worker method by name on every rank of the worker's group (the worker
        serves sleep mode's: `CallWorkerMethod`); the results in rank order. The
        worker's refusal is a RuntimeError (ValueError for bad arguments) with its
        reason; a worker that cannot be reached is WorkerUnavailable."""
        if not isinstance(method, str):
            raise TypeError("the gpu-worker runs worker methods by name only")
        request = pb.CallWorkerMethodRequest(
            method=method, arguments_json=json.dumps({"args": list(args),
                                                      "kwargs": kwargs or {}}))
        try:
            # The worker's next step waits for this one: reloading weights takes a while.
            reply = self._stub.CallWorkerMethod(request, timeout=self.step_timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise RuntimeError(exc.details()) from None
            raise WorkerUnavailable(f"gpu-worker at {self.address} failed in CallWorkerMethod"
                                    f": {exc.code().name}: {exc.details()}") from exc
        return json.loads(reply.results_json)

    def shutdown(self) -> None:
        self._channel.close()

    def _call(self, method: str, request, timeout: float | None = 600.0):
        try:
            return getattr(self._stub, method)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise WorkerUnavailable(f"gpu-worker at {self.address} failed in {method}: "
                                    f"{exc.code().name}: {exc.details()}") from exc


def _step_failed(exc: grpc.RpcError) -> bool:
    """Whether the worker said it failed midway through the step (and lives on)."""
    if exc.code() != grpc.StatusCode.INTERNAL:
        return False
    return any(key == STEP_FAILED_KEY for key, _ in exc.trailing_metadata() or ())


def _rejected_request(exc: grpc.RpcError) -> str | None:
    """The request a worker named when it refused a step (INVALID_ARGUMENT), if any."""
    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == REJECTED_REQUEST_KEY:
            return value
    return None
