"""Structured outputs in the step loop: the offline engine at batch 32, json_schema against
unconstrained, phase by phase (not a pytest file).

    .venv/bin/python benchmarks/bench_structured_engine.py [--rounds 2] [--num-prompts 32]

Each round runs the same batch twice, unconstrained and with `pagoda bench serve
--structured json_schema`'s schema (random prompts, greedy, `ignore_eos`, so both do the
same number of steps unless the grammar ends an answer), alternating which goes first.

Why CPU time and not only tokens/s: on a shared machine the wall clock measures the
neighbours (the same run varies by 2x); the engine thread's CPU time does not. With
`--threads 1` (the default) torch computes on the engine thread too, so that thread's
CPU time is the step's whole cost, and `out tok per CPU s` is the throughput the batch
would have on a dedicated core. The per-step columns split it: `schedule` (the plan,
the bitmask included), `bitmask` (the manager's fill), `execute` (forward + sampling),
`apply` (the worker's masking, inside execute) and `update` (matchers advanced).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

import pagoda.sample.grammar as worker_grammar
from pagoda.core.scheduler import Scheduler
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.services.bench.structured import REPORT_SCHEMA
from pagoda.structured_output.manager import StructuredOutputManager

PHASES = ("schedule", "bitmask", "execute", "apply", "update")


class PhaseClock:
    """Wall and engine-thread CPU seconds spent in the wrapped calls, by phase."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall[phase] += time.perf_counter() - wall
                self.cpu[phase] += time.thread_time() - cpu

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()


@contextmanager
def engine_thread_clock():
    """Yields a dict filled on exit with the wall and engine-thread CPU seconds."""
    result: dict[str, float] = {}
    wall, cpu = time.perf_counter(), time.thread_time()
    yield result
    result["wall"] = time.perf_counter() - wall
    result["cpu"] = time.thread_time() - cpu


def run_batch(engine: LLMEngine, args, structured: bool, tag: str, rng: random.Random
              ) -> tuple[int, int]:
    """Runs one batch to completion; (output tokens, steps)."""
    constraint = StructuredOutputsParams(json=REPORT_SCHEMA) if structured else None
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0,
                            structured_outputs=constraint)
    for i in range(args.num_prompts):
        prompt = [rng.randrange(100, 40000) for _ in range(args.input_len)]
        engine.add_request(None, prompt, params, request_id=f"{tag}-{i}")
    num_tokens = num_steps = 0
    while engine.core.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                num_tokens += sum(len(c.token_ids) for c in output.outputs)
        num_steps += 1
    return num_tokens, num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Default: the default model.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineArgs(model=args.model))
    clock = PhaseClock()
    clock.wrap(Scheduler, "schedule", "schedule")
    clock.wrap(Scheduler, "update_from_output", "update")
    clock.wrap(StructuredOutputManager, "grammar_bitmask", "bitmask")
    clock.wrap(worker_grammar, "apply_grammar_bitmask", "apply")
    clock.wrap(engine.core.executor, "execute_model", "execute")
    rng = random.Random(0)
    for structured in (False, True):  # warm-up: compile the grammar, touch every path
        run_batch(engine, argparse.Namespace(**{**vars(args), "num_prompts": 2}),
                  structured, f"warm-{structured}", rng)
    rows = []
    for round_ in range(args.rounds):
        order = (False, True) if round_ % 2 == 0 else (True, False)
        for structured in order:
            clock.reset()
            with engine_thread_clock() as total:
                num_tokens, num_steps = run_batch(engine, args, structured,
                                                  f"r{round_}-{structured}", rng)
            rows.append((round_, structured, num_tokens, num_steps, total, dict(clock.cpu)))
    print(f"| round | mode | out tok | steps | wall s | CPU s | out tok/s | out tok per CPU s | "
          f"{' | '.join(f'{p} ms/step (CPU)' for p in PHASES)} |")
    print("|" + "---|" * (8 + len(PHASES)))
    for round_, structured, num_tokens, num_steps, total, cpu in rows:
        phases = " | ".join(f"{cpu.get(p, 0.0) / num_steps * 1000:.3f}" for p in PHASES)
        print(f"| {round_} | {'json_schema' if structured else 'none'} | {num_tokens} | "
              f"{num_steps} | {total['wall']:.2f} | {total['cpu']:.2f} | "
              f"{num_tokens / total['wall']:.1f} | {num_tokens / total['cpu']:.1f} | {phases} |")
    for basis in ("wall", "cpu"):
        rate = {s: sum(r[2] for r in rows if r[1] == s) / sum(r[4][basis] for r in rows
                                                               if r[1] == s)
                for s in (False, True)}
        print(f"json_schema / none, out tok per {basis} s: {rate[True] / rate[False]:.1%}")


if __name__ == "__main__":
    main()
