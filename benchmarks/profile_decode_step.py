"""Where a decode step's time goes at batch 64 in the offline engine (not a pytest file).

    .venv/bin/python benchmarks/profile_decode_step.py [--batch 64] [--steps 32] [--engine-args JSON]

64 requests with 128-token prompts are prefilled, then `--steps` decode steps of all 64 run
twice: once plain (the step time reported) and once under torch.profiler, whose per-op
self CPU time goes into buckets by op name: matmul (the prepacked oneDNN product, F.linear,
int4/int8 kernels), attention (the fused paged decode kernel, SDPA), gather (KV writes,
index/cat/stack building inputs), sampling (argmax/softmax/topk/sort/...), norm/activation
(the fused RMSNorm, SiLU-and-mul and rotary kernels, elementwise ops), other torch ops.
"python and the rest" is the profiled step time less the ops' time: the scheduler, input
building, the model's module calls and the profiler's own per-op cost (so it reads high;
`ms_per_step` is the plain run's step, `ms_per_step_profiled` the profiled one's).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

BUCKETS = {
    "matmul": ("linear", "_weight_int4pack_mm", "_weight_int8pack_mm", "int4_gemv", "int8_gemv",
               "addmm", "matmul", "bmm", "::mm"),
    "attention": ("paged_decode_attention", "scaled_dot_product_attention", "_attention"),
    # The fused decode stack's own time: every layer's norms, rotary, KV write, decode
    # attention and SiLU-and-mul (its int4 products are profiled as matmul ops).
    "fused decode layers": ("decode_layers",),
    "gather": ("write_kv_cache", "index_select", "index_copy", "cat", "stack", "gather",
               "index_put", "take", "embedding"),
    "sampling": ("race_argmax", "argmax", "topk", "softmax", "sort", "multinomial", "uniform_", "exponential",
                 "log_softmax"),
    "norm/activation": ("rms_norm", "silu", "gelu", "rotary_embedding", "::mul", "::add",
                        "rsqrt"),
}


def bucket_of(name: str) -> str:
    for bucket, keys in BUCKETS.items():
        if any(key in name for key in keys):
            return bucket
    return "other torch ops"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--engine-args", default="{}", help="JSON of LLM keyword arguments.")
    args = parser.parse_args()
    from pagoda import LLM, SamplingParams
    from pagoda.bench.throughput import synthetic_prompts

    llm = LLM(max_model_len=1024, **json.loads(args.engine_args))
    engine = llm.llm_engine
    prompts = synthetic_prompts(args.batch, 128, engine.config.arch.vocab_size, seed=0)
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 8, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for i, prompt in enumerate(prompts):
        engine.add_request(None, prompt, params, request_id=f"r{i}")
    while engine.core.get_stats().num_waiting or any(  # prefill everything first
            r.num_computed_tokens < r.num_tokens - 1 for r in engine.core.scheduler.running):
        engine.step()
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall_ms = (time.perf_counter() - start) * 1000 / args.steps
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    profiled_ms = (time.perf_counter() - start) * 1000 / args.steps
    by_op: collections.Counter = collections.Counter()
    for event in prof.key_averages():
        by_op[event.key] += event.self_cpu_time_total / 1000 / args.steps  # ms per step
    per_step = collections.Counter()
    for name, ms in by_op.items():
        per_step[bucket_of(name)] += ms
    per_step = {k: round(per_step.get(k, 0.0), 2) for k in [*BUCKETS, "other torch ops"]}
    per_step["python and the rest"] = round(profiled_ms - sum(per_step.values()), 2)
    top = {name: round(ms, 3) for name, ms in by_op.most_common(12)}
    print(json.dumps({"batch": args.batch, "steps": args.steps, "ms_per_step": round(wall_ms, 2),
                      "ms_per_step_profiled": round(profiled_ms, 2),
                      "engine_args": json.loads(args.engine_args), "ms_by_bucket": per_step,
                      "share": {k: round(v / profiled_ms, 3) for k, v in per_step.items()},
                      "top_ops_ms_per_step": top}, indent=2))
    while engine.has_unfinished_requests():
        engine.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
