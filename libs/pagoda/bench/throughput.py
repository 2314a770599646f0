"""`pagoda bench throughput`: the offline engine on synthetic prompts.

Prints one JSON line. Prompts are random token ids (seeded) of exactly
`--input-len` tokens, generated with `ignore_eos` to exactly `--output-len`
tokens, so every run does the same work.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import TYPE_CHECKING

from pagoda.engine.arg_utils import EngineArgs
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.entrypoints.llm import LLM

def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("throughput", help="Offline engine throughput on synthetic prompts.")
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1, help="Warm-up requests before timing.")
    parser.set_defaults(func=run)
    return parser


def synthetic_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids, where the special tokens live.
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(num)]


def offline_llm(args: argparse.Namespace) -> LLM:
    """The offline engine the command line describes (`EngineArgs` flags), its context
    at least 2048 tokens and the benchmark's `--input-len` + `--output-len` unless
    `--max-model-len` is given."""
    from pagoda.entrypoints.llm import LLM  # lazy: torch and the model code, only when a benchmark runs

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_model_len is None:
        engine_args.max_model_len = max(2048, args.input_len + args.output_len)
    return LLM(**vars(engine_args))


def run(args: argparse.Namespace) -> int:
    llm = offline_llm(args)
    config = llm.llm_engine.config
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if args.warmup:
        warm = synthetic_prompts(args.warmup, args.input_len, config.arch.vocab_size, seed=1)
        llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    # A fresh cache so warm-up prompts cannot hit (they are different anyway).
    llm.llm_engine.core.reset_prefix_cache()
    prompts = synthetic_prompts(args.num_prompts, args.input_len, config.arch.vocab_size)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(json.dumps({
        "model": config.served_model_name[0], "dtype": config.dtype,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(outputs) / elapsed, 3),
        "output_tokens_per_s": round(num_out / elapsed, 2),
        "total_tokens_per_s": round((num_in + num_out) / elapsed, 2),
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
    }))
    return 0
