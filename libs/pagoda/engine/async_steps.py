"""Async scheduling (vLLM's `--async-scheduling`): plan step N+1 while step N runs.

How it stays exact (the reconciliation rules, `pagoda.core.scheduler`):

  * When a step is planned that reaches the end of a request's tokens, the request
    will sample one token there: the scheduler counts it as a placeholder
    (`Request.num_output_placeholders`) and may plan the request's next step at once,
    with the placeholder as its input. The worker keeps each request's sampled ids
    (`CachedRequestState`), and runs plans in the order they were made, so step N+1
    reads the token step N sampled: the scheduler never needs its value to plan.
  * When step N's output arrives, its tokens replace the placeholders, in order, and
    the stop rules run on them as in a synchronous step. A request that finished at
    step N (EOS, stop token) ran one wasted slot in step N+1: that token is dropped
    (the request is gone when it arrives), and the worker is told to forget the
    request with the next plan. A request that would reach `max_tokens` (or the
    context) at step N is not planned into N+1 at all.
  * A request preempted while one of its steps is in flight keeps the token that step
    sampled (its seeded stream advanced on the worker): it resumes with it. A waiting
    request with a placeholder left is not admitted before the token arrives.
  * A constrained request (structured outputs) steps only once its last token is
    known: its grammar mask depends on it. It is exact, at half its decode rate.
  * Anything that ends requests from outside the step (abort, stop strings, client
    gone) ends them at once; tokens still in flight for them are dropped on arrival.

What cannot be made exact this way is refused at start-up
(`refuse_async_scheduling_combinations`, and P/D KV transfer in the scheduler
service): drafts are verified with the scheduler's view of the last token
(speculative decoding), a pipeline group already keeps several micro-batches in
flight, and a pooling request finishes in the step that runs it.

`SerialExecutor` submits steps without waiting, and makes every other executor call
wait for the steps in flight, so a step is never overtaken by anything else sent to
the worker (sleep, KV reset, collective RPCs). Over gRPC the next step is sent while
the last one runs; the gpu-worker queues it until its turn (`step_id` order), so it
starts the moment the last one ends.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from pagoda.config import SchedulerConfig
from pagoda.executor.base import Executor
from pagoda.messages import ModelRunnerOutput, SchedulerOutput

# Plans in flight at most: the one running and the one queued behind it.
MAX_STEPS_IN_FLIGHT = 2


def refuse_async_scheduling_combinations(config: SchedulerConfig, pipeline_parallel_size: int,
                                         runner: str) -> None:
    """ValueError naming the combination when --async-scheduling meets a feature it
    cannot keep exact."""
    if not config.async_scheduling:
        return
    if config.speculative_config is not None:
        raise ValueError("--async-scheduling is not supported with speculative decoding "
                         "(--speculative-config): drafts are verified against the last "
                         "token the scheduler knows")
    if pipeline_parallel_size > 1:
        raise ValueError("--async-scheduling is not supported with pipeline parallelism "
                         "(--pipeline-parallel-size > 1)")
    if runner != "generate":
        raise ValueError("--async-scheduling is not supported with pooling models "
                         f"(--runner {runner}): a pooling request ends in the step that runs it")


def refuse_async_kv_transfer(async_scheduling: bool, kv_role: str) -> None:
    """ValueError for --async-scheduling on a prefill or decode replica of P/D."""
    if async_scheduling and kv_role in ("kv_producer", "kv_consumer"):
        raise ValueError(f"--async-scheduling is not supported with KV transfer "
                         f"(--kv-transfer-config kv_role {kv_role}): a prompt's blocks are "
                         "handed over between steps")


class SerialExecutor(Executor):
    """Wraps an executor so that steps can be submitted without waiting, and nothing
    else sent to the worker overtakes them: every other call first waits for the steps
    in flight to end (their outputs stay in their futures).

    A step goes out through the executor's own `submit_step` when it has one (the
    gRPC executor: the worker queues a step sent ahead until its turn), else on one
    step thread, in order (an in-process model runner or simulated device)."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self._native = getattr(inner, "submit_step", None)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagoda-step")
        self._outstanding: list[concurrent.futures.Future] = []

    def _call(self, fn, *args, **kwargs):
        if self._outstanding:
            concurrent.futures.wait(self._outstanding)
            self._outstanding.clear()
        return fn(*args, **kwargs)

    def submit_step(self, plan: SchedulerOutput) -> concurrent.futures.Future:
        if self._native is not None:
            future = self._native(plan)
        else:
            future = self._thread.submit(self.inner.execute_model, plan)
        self._outstanding = [f for f in self._outstanding if not f.done()]
        self._outstanding.append(future)
        return future

    def determine_num_blocks(self) -> int:
        return self._call(self.inner.determine_num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call(self.inner.initialize_kv_cache, num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call(self.inner.execute_model, scheduler_output)

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return self._call(self.inner.collective_rpc, method, args, kwargs)

    def kv_cache_geometry(self):
        return self._call(self.inner.kv_cache_geometry)

    def export_kv_blocks(self, block_ids: list[int]):
        return self._call(self.inner.export_kv_blocks, block_ids)

    def import_kv_blocks(self, block_ids: list[int], blocks) -> None:
        self._call(self.inner.import_kv_blocks, block_ids, blocks)

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            self._thread.shutdown(wait=False)

    def __getattr__(self, name: str) -> Any:
        # Executor-specific attributes (a gRPC executor's address, a group's ranks).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)
