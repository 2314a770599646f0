"""`pagoda bench latency`: how long one batch takes end to end in the offline engine.

Like `vllm bench latency`: a batch of `--batch-size` random prompts of exactly
`--input-len` tokens, each generated to exactly `--output-len` tokens
(`ignore_eos`, temperature 1), run `--num-iters-warmup` times untimed and then
`--num-iters` times timed. Prints the average and the 10/25/50/75/90/99th
percentile latencies; `--output-json FILE` writes vLLM's keys (`avg_latency`,
`latencies`, `percentiles`) plus the settings and the tokens/s they imply.
Every iteration clears the prefix cache first, so each one computes its
prompts afresh rather than hitting what the previous one cached.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagoda.bench.throughput import synthetic_prompts
from pagoda.engine.arg_utils import EngineArgs
from pagoda.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("latency", help="Offline latency of one batch, end to end.",
                                   description=__doc__.split("\n\n")[0])
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=1, help="Completions per prompt.")
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--output-json", default=None, help="Write the results to this file.")
    parser.set_defaults(func=run)
    return parser


def summarize(args: argparse.Namespace, model: str, latencies: list[float]) -> dict:
    """vLLM's `--output-json` keys, then the settings and the tokens/s they imply
    (prompt and output tokens of the whole batch over the average latency)."""
    avg = statistics.fmean(latencies)
    num_out = args.batch_size * args.n * args.output_len
    return {
        "avg_latency": avg,
        "latencies": latencies,
        "percentiles": {str(q): percentile(latencies, q) for q in PERCENTILES},
        "model": model, "input_len": args.input_len, "output_len": args.output_len,
        "batch_size": args.batch_size, "n": args.n, "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
        "output_tokens_per_s": round(num_out / avg, 2),
        "total_tokens_per_s": round((num_out + args.batch_size * args.input_len) / avg, 2),
    }


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as vLLM uses)."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run(args: argparse.Namespace) -> int:
    # lazy: the LLM brings torch and the engine; the CLI imports this module for its flags
    from pagoda.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_model_len is None:
        engine_args.max_model_len = max(2048, args.input_len + args.output_len)
    llm = LLM(**vars(engine_args))
    config = llm.llm_engine.config
    params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True,
                            max_tokens=args.output_len)
    prompts = synthetic_prompts(args.batch_size, args.input_len, config.arch.vocab_size,
                                seed=engine_args.seed)

    def run_to_completion() -> float:
        llm.llm_engine.core.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        run_to_completion()
    latencies = [run_to_completion() for _ in range(args.num_iters)]
    result = summarize(args, config.served_model_name[0], latencies)
    print(f"Avg latency: {result['avg_latency']:.6f} seconds")
    for q, value in result["percentiles"].items():
        print(f"{q}% percentile latency: {value:.6f} seconds")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=4)
    return 0
