"""A conversation's second turn on a hybrid model (Granite-4.0-H: Mamba2 + attention),
prefix caching off vs on (state checkpoints at block boundaries,
pagoda.core.state_checkpoints): time to the first token of turn 2, whose prompt is
turn 1's prompt + its answer + a new message.

    .venv/bin/python benchmarks/bench_hybrid_prefix_cache.py [--prompt-len 1000]

The model is the test suite's tiny random Granite-4.0-H (4 layers, 3 of them Mamba2,
SmolLM2's vocabulary), fp32 on the CPU: the ratio shows how much of the prompt is
skipped, not what a real checkpoint costs on a GPU.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "model" / "architectures"), str(ROOT / "tests")]

from arch_parity import random_prompts, save_tiny_checkpoint  # noqa: E402
from test_granitemoehybrid import granite_hybrid_config  # noqa: E402

from pagoda import LLM, SamplingParams  # noqa: E402
from pagoda.model.loader import default_model_path  # noqa: E402
from pagoda.tokenizer.loader import load_tokenizer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    path = save_tiny_checkpoint(tempfile.mkdtemp(), granite_hybrid_config(
        position_embedding_type=None, max_position_embeddings=4 * args.prompt_len),
        load_tokenizer(default_model_path()))
    first = random_prompts([args.prompt_len], seed=1)[0]
    answer_params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for caching in (False, True):
        llm = LLM(model=path, dtype="float32", enable_prefix_caching=caching, block_size=16,
                  max_model_len=4 * args.prompt_len, num_gpu_blocks_override=1024)
        times, cached = [], 0
        for trial in range(args.trials):
            [out] = llm.generate([{"prompt_token_ids": first}], answer_params, use_tqdm=False)
            second = first + list(out.outputs[0].token_ids) + random_prompts(
                [24], seed=10 + trial)[0]
            start = time.perf_counter()
            [out] = llm.generate([{"prompt_token_ids": second}], one_token, use_tqdm=False)
            times.append(time.perf_counter() - start)
            cached = out.num_cached_tokens
        median = sorted(times)[len(times) // 2]
        print(f"prefix caching {'on ' if caching else 'off'}: turn-2 TTFT {median * 1000:.1f} ms "
              f"(median of {args.trials}), {cached} of {len(second)} prompt tokens from the "
              "cache", flush=True)
        del llm


if __name__ == "__main__":
    main()
