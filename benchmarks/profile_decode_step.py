"""Where a decode step's time goes at batch 64 in the offline engine (not a pytest file).

    .venv/bin/python benchmarks/profile_decode_step.py [--batch 64] [--steps 32] [-- engine args as JSON]

64 requests with 128-token prompts are prefilled, then `--steps` decode steps of all 64 run
under cProfile. Each C-level call's own time is put in a bucket by what it is: matmul
(linear layers and the LM head, bf16 or int4), attention (SDPA, the paged-attention
reads, the fused CPU decode kernel), gather (index_select/index_copy/cat/stack building K/V and inputs), sampling
(argmax/softmax/topk and the sampler's Python), norm/activation, other torch ops; the rest
of the wall time is Python (the scheduler, input building, the model's module calls).
Prints one JSON object: ms per step by bucket and their shares.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

BUCKETS = {
    "matmul": ("linear", "_weight_int4pack_mm", "addmm", "matmul", "bmm", "mm"),
    "attention": ("scaled_dot_product_attention", "paged_attention", "_decode_attention",
                  "softmax_attention"),
    "gather": ("index_select", "index_copy", "cat", "stack", "gather", "index_put", "take"),
    "sampling": ("argmax", "topk", "softmax", "sort", "multinomial", "uniform_", "exponential"),
    "norm/activation": ("rms_norm", "silu", "gelu", "mul", "add", "rsqrt"),
}


# pagoda.kernels.cpu's wrappers call the C++ ops through callables cProfile does not
# see as C calls, so their own time is the kernels' time (plus a line of Python).
CPU_KERNELS_FILE = "kernels/cpu/__init__.py"
CPU_KERNEL_BUCKETS = {"paged_decode_attention": "attention", "write_kv_cache": "gather",
                      "rms_norm": "norm/activation", "silu_and_mul": "norm/activation",
                      "rotary_embedding": "norm/activation"}


def bucket_of(name: str) -> str | None:
    for bucket, keys in BUCKETS.items():
        if any(key in name for key in keys):
            return bucket
    return None


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
    params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    for i, prompt in enumerate(prompts):
        engine.add_request(None, prompt, params, request_id=f"r{i}")
    while engine.core.get_stats().num_waiting or any(  # prefill everything first
            r.num_computed_tokens < r.num_tokens - 1 for r in engine.core.scheduler.running):
        engine.step()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        engine.step()
    profile.disable()
    wall_ms = (time.perf_counter() - start) * 1000 / args.steps
    totals = {bucket: 0.0 for bucket in BUCKETS}
    totals["other torch ops"] = 0.0
    for (file, _, name), (_, _, tottime, _, _) in pstats.Stats(profile).stats.items():
        if file.endswith(CPU_KERNELS_FILE):  # the fused C++ kernels' calls count as theirs
            totals[CPU_KERNEL_BUCKETS.get(name, "other torch ops")] += tottime
            continue
        if file != "~":  # Python functions: their own time is Python
            if "sample" in file and "pagoda" in file:
                totals["sampling"] += tottime
            continue
        bucket = bucket_of(name) or ("other torch ops" if "torch" in name or "method" in name
                                     else None)
        if bucket:
            totals[bucket] += tottime
    per_step = {k: round(v * 1000 / args.steps, 2) for k, v in totals.items()}
    per_step["python and the rest"] = round(wall_ms - sum(per_step.values()), 2)
    print(json.dumps({"batch": args.batch, "steps": args.steps, "ms_per_step": round(wall_ms, 2),
                      "engine_args": json.loads(args.engine_args), "ms_by_bucket": per_step,
                      "share": {k: round(v / wall_ms, 3) for k, v in per_step.items()}},
                     indent=2))
    while engine.has_unfinished_requests():
        engine.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
