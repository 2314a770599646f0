"""The served scheduler's CPU per decode step, in one process (not a pytest file).

    .venv/bin/python benchmarks/profile_scheduler_step.py --model DIR [--batch 64,128,256]
        [--steps 200] [--prompt-len 128] [--profile [N]]

`DIR`: any small HF model directory (the tests' tiny_llama, for one: tests/conftest.py
builds it under /tmp/pytest-of-*/pytest-*/tiny_llama0). The device is
`--simulated-device '{"base_ms": 0.001}'` (it must be positive; a step's own bookkeeping
already outlasts 1 us, so it never sleeps): a step costs only the control plane's CPU.

The step goes through the pieces of the served path that run in the scheduler process,
as the scheduler service wires them (engine_loop.py `EngineLoop._step`):
- schedule: `Scheduler.schedule` (the plan, block allocation, hooks);
- plan: `scheduler_output_to_proto` and its serialisation (worker_executor.py), and
  parsing the worker's reply (`model_runner_output_from_proto`);
- update: `Scheduler.update_from_output`;
- outputs: the engine loop's stats and metrics (`get_stats`, the recorder's `on_step`)
  and the servicer's stream path: `--stream mux` (default) every request on one
  `GenerateStream` (deliver, `_collect`, one batch serialised per step); `--stream
  generate` one `Generate` stream per request (`outputs_to_responses` and a message
  serialised per request);
- worker (not the scheduler's CPU, shown apart): the gpu-worker's side of the call
  (parse, `PlanLedger` check and record, the simulated step, the reply's proto).
`sched_total` is the sum of the first four: the scheduler's CPU per step, during which
the worker waits.

Batch B: B requests with `--prompt-len`-token prompts (distinct random tokens, no prefix
hits) are prefilled, then `--steps` decode steps of all B are timed. `--profile N`
runs the timed steps again under cProfile and prints the top N functions by own time.
Prints one JSON line per batch size.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import json
import pstats
import random
import time


class _Timer:
    """CPU seconds (this thread's: robust to a loaded machine) per named piece."""

    def __init__(self) -> None:
        self.total = collections.Counter()

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.thread_time() - start
        return timed


class _WireExecutor:
    """The scheduler's `GrpcWorkerExecutor` and the gpu-worker's `ExecuteModel`, minus
    the network: the plan and the reply go through their protos as bytes."""

    def __init__(self, config, timer: _Timer) -> None:
        from pagoda.executor.simulated import SimulatedExecutor
        from pagoda.worker.plan_checks import PlanLedger

        self.device = SimulatedExecutor(config)
        self.ledger = PlanLedger(0, config.cache.block_size, config.arch.vocab_size,
                                 config.scheduler.max_model_len)
        self.timer = timer
        self.step_id = 0

    def determine_num_blocks(self) -> int:
        return self.device.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.device.initialize_kv_cache(num_blocks)
        self.ledger.reset(num_blocks)

    def execute_model(self, scheduler_output):
        from pagoda.services._proto.pagoda.worker.v1 import worker_pb2 as pb
        from pagoda.services.common.protocol.worker import (model_runner_output_from_proto,
                                                            model_runner_output_to_proto,
                                                            scheduler_output_from_proto,
                                                            scheduler_output_to_proto)

        start = time.thread_time()
        wire = pb.ExecuteModelRequest(
            step_id=self.step_id,
            # As served between this version's scheduler and worker: columns both ways.
            scheduler_output=scheduler_output_to_proto(scheduler_output, block_columns=True)
        ).SerializeToString()
        plan_s = time.thread_time() - start
        start = time.thread_time()
        plan = scheduler_output_from_proto(
            pb.ExecuteModelRequest.FromString(wire).scheduler_output)
        self.ledger.check(plan)
        output = self.device.execute_model(plan)
        self.ledger.record(plan, output)
        reply = pb.ExecuteModelResponse(
            model_runner_output=model_runner_output_to_proto(output, columns=True)
        ).SerializeToString()
        worker_s = time.thread_time() - start
        start = time.thread_time()
        result = model_runner_output_from_proto(
            pb.ExecuteModelResponse.FromString(reply).model_runner_output)
        self.timer.total["plan"] += plan_s + time.thread_time() - start
        self.timer.total["worker"] += worker_s
        self.step_id += 1
        return result

    def submit_step(self, scheduler_output):
        """Async scheduling (`--async-scheduling`): the step runs at once, on this
        thread, as `execute_model`; its output waits in a done future."""
        import concurrent.futures

        future = concurrent.futures.Future()
        future.set_result(self.execute_model(scheduler_output))
        return future

    def shutdown(self) -> None:
        self.device.shutdown()


def _mux_outputs(batch: int):
    """The servicer's `GenerateStream` path for one connection holding every request
    (generate_mux.py): each output delivered to its request, then the step's one batch
    collected and serialised."""
    from pagoda.services.scheduler.generate_mux import MuxConnection, MuxRequest, dispatch

    class _Servicer:
        def release(self, *args, **kwargs) -> None:
            pass

    connection = MuxConnection(_Servicer(), None)
    streams = {f"r{i}": MuxRequest(f"r{i}", connection) for i in range(batch)}
    connection.requests.update(streams)

    def on_outputs(outputs) -> None:
        dispatch(streams, outputs)  # the servicer's _dispatch
        connection.ready.clear()
        sent: list = []
        connection._collect(sent).SerializeToString()

    return on_outputs


def _build(model: str, batch: int, prompt_len: int, steps: int, timer: _Timer,
           stream: str = "generate", async_scheduling: bool = False):
    """An engine loop wired as the scheduler service wires it, with `batch` requests
    prefilled."""
    from prometheus_client import CollectorRegistry

    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.engine_core import EngineCore
    from pagoda.messages import EngineCoreRequest
    from pagoda.metrics.engine_metrics import EngineMetrics
    from pagoda.sampling_params import SamplingParams
    from pagoda.services.common.protocol.scheduler import outputs_to_responses
    from pagoda.services.scheduler.engine_loop import EngineLoop
    from pagoda.services.scheduler.metrics import SchedulerStatsRecorder

    max_len = prompt_len + 3 * steps + 64
    config = EngineArgs(model=model, simulated_device={"base_ms": 0.001}, max_num_seqs=batch,
                        max_num_batched_tokens=max(8192, batch), max_model_len=max_len,
                        num_gpu_blocks_override=batch * (max_len // 16 + 2),
                        async_scheduling=async_scheduling).create_engine_config()
    core = EngineCore(config, _WireExecutor(config, timer))
    metrics = EngineMetrics(config.served_model_name[0], max_len, registry=CollectorRegistry())
    recorder = SchedulerStatsRecorder(metrics, None)
    streams: dict[str, list] = {}

    def on_outputs(outputs) -> None:  # servicer._dispatch, then each stream's handler
        for out in outputs:
            streams.setdefault(out.request_id, []).append(out)
        for rid in list(streams):
            for response in outputs_to_responses(streams.pop(rid)):
                response.SerializeToString()

    if stream == "mux":
        on_outputs = _mux_outputs(batch)
    loop = EngineLoop(core, on_outputs, lambda events: None, lambda exc: None, recorder)
    sched = core.scheduler
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update_from_output = timer.wrap("update", sched.update_from_output)
    rng = random.Random(0)
    vocab = config.arch.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps + 16, ignore_eos=True)
    adds = []
    for i in range(batch):
        prompt = [rng.randrange(256, vocab) for _ in range(prompt_len)]
        request = EngineCoreRequest(f"r{i}", prompt, params, eos_token_ids=[0])
        adds.append((request, recorder))
    for request, _ in adds:
        core.add_request(request)
        recorder.on_add(request)
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        loop._step()
    return loop


def _measure(loop, steps: int, timer: _Timer) -> dict:
    timer.total.clear()
    start, cpu = time.thread_time(), time.process_time()
    for _ in range(steps):
        loop._step()
    wall, cpu = time.thread_time() - start, time.process_time() - cpu  # wall: thread CPU
    per = {k: 1e3 * v / steps for k, v in timer.total.items()}
    # `outputs`: everything in the step that is neither the core's nor the worker's.
    per["outputs"] = 1e3 * wall / steps - sum(per.values())
    per["sched_total"] = sum(per[k] for k in ("schedule", "plan", "update", "outputs"))
    per["process_cpu"] = 1e3 * cpu / steps
    return {k: round(v, 3) for k, v in per.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a small HF model directory")
    parser.add_argument("--batch", default="64,128,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--stream", choices=("generate", "mux"), default="mux",
                        help="the servicer's stream path measured under `outputs`: one "
                             "Generate stream per request, or every request on one "
                             "GenerateStream (the gateway's default)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="plan step N+1 before applying N's output, as `pagoda serve "
                             "--async-scheduling` does (the device runs each step at once)")
    parser.add_argument("--profile", type=int, nargs="?", const=30, default=0,
                        help="print the top N functions by own time (default 30)")
    args = parser.parse_args()
    import logging

    logging.disable(logging.INFO)  # the stats line and cache sizes are not measured
    for batch in (int(b) for b in args.batch.split(",")):
        timer = _Timer()
        loop = _build(args.model, batch, args.prompt_len, args.steps, timer, args.stream,
                      args.async_scheduling)
        _measure(loop, 20, timer)  # warm-up
        result = {"batch": batch, "stream": args.stream, "steps": args.steps,
                  **_measure(loop, args.steps, timer)}
        print(json.dumps(result), flush=True)
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            _measure(loop, args.steps, timer)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
