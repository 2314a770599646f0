"""KV cache tiers: a multi-turn workload whose revisited prefixes are ~4x the device
KV pool, with the host tier off and on (--kv-offloading-size); not a pytest file.

    .venv/bin/python benchmarks/bench_kv_tiers.py [--model M] [--prefix-len 2048]
        [--conversations 8] [--rounds 3] [--pool-ratio 4] [--tier-gib 2]

Each of `conversations` chats has a random `prefix-len`-token context; round r sends
every chat, round-robin, its context plus r+1 user turns of 32 tokens (max_tokens 16,
greedy, one request at a time). The device pool holds 1/`pool-ratio` of all contexts
(`--num-gpu-blocks-override`), so by the time a chat comes back its context was evicted:
without a tier it is recomputed, with one it is onloaded from host memory. Round 0 is
cold for both runs and left out; the rounds after it are measured:

    ttft_p50/p90   time from submitting a revisit to the step that samples its first
                   token (the scheduler's first_token_time; in-process, no network), s
    throughput     revisits per second and tokens (prompt + generated) per second
    copy per block host tier -> device, and device -> host tier, per block (checksums
                   included), from the worker's own counters
    recompute per block  the tier-off revisit's TTFT over its prompt blocks

The outputs of both runs are compared token for token (they must be equal). Prints
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

BLOCK = 16
TURN = 32
MAX_TOKENS = 16


def workload(args) -> list[list[list[int]]]:
    """rounds x conversations prompts (token ids)."""
    rng = random.Random(0)
    contexts = [[1] + [rng.randrange(100, 40000) for _ in range(args.prefix_len - 1)]
                for _ in range(args.conversations)]
    turns = [[[rng.randrange(100, 40000) for _ in range(TURN)] for _ in range(args.rounds)]
             for _ in range(args.conversations)]
    return [[ctx + sum(turns[c][:r + 1], []) for c, ctx in enumerate(contexts)]
            for r in range(args.rounds)]


def run(args, prompts, tier_gib: float) -> dict:
    from pagoda import SamplingParams
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    # A quarter of the contexts (--pool-ratio 4), at least room for one request.
    pool_tokens = max(args.conversations * args.prefix_len // args.pool_ratio,
                      args.prefix_len + TURN * args.rounds + MAX_TOKENS + 2 * BLOCK)
    engine = LLMEngine(EngineArgs(
        model=args.model, max_model_len=args.prefix_len + TURN * args.rounds + MAX_TOKENS + 64,
        block_size=BLOCK, num_gpu_blocks_override=pool_tokens // BLOCK,
        kv_offloading_size=tier_gib or None))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ttfts, outputs, tokens, start = [], [], 0, None
    for r, round_prompts in enumerate(prompts):
        if r == 1:
            start = time.perf_counter()
        for prompt in round_prompts:
            t0 = time.time()
            request_id = engine.add_request(None, prompt, params)
            first, out = None, None
            while engine.has_unfinished_requests():
                finished = engine.step()
                request = engine.core.scheduler.requests.get(request_id)
                if first is None and request is not None and request.first_token_time:
                    first = request.first_token_time - t0  # the scheduler's clock
                for o in finished:
                    out = list(o.outputs[0].token_ids)
            if r >= 1:
                ttfts.append(first)
                tokens += len(prompt) + len(out)
            outputs.append(out)
    wall = time.perf_counter() - start
    runner = engine.core.executor.runner
    result = {"ttft_p50_s": statistics.median(ttfts),
              "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1],
              "revisits_per_s": len(ttfts) / wall, "tokens_per_s": tokens / wall,
              "device_pool_blocks": pool_tokens // BLOCK}
    tier = runner.host_tier
    if tier is not None:
        s = tier.stats
        result.update({
            "tier_slots": tier.num_slots, "block_bytes": tier.block_bytes,
            "onloaded_blocks": s.onloaded_blocks, "offloaded_blocks": s.offloaded_blocks,
            "failed_onloads": s.failed_onloads,
            "onload_ms_per_block": 1e3 * s.onload_seconds / max(s.onloaded_blocks, 1),
            "offload_ms_per_block": 1e3 * s.offload_seconds / max(s.offloaded_blocks, 1)})
    return result, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-ratio", type=int, default=4)
    parser.add_argument("--tier-gib", type=float, default=2.0)
    args = parser.parse_args()
    prompts = workload(args)
    off, off_out = run(args, prompts, 0.0)
    on, on_out = run(args, prompts, args.tier_gib)
    prompt_blocks = (args.prefix_len + TURN * 2) / BLOCK
    report = {
        "workload": {"prefix_len": args.prefix_len, "conversations": args.conversations,
                     "rounds": args.rounds, "working_set_over_pool": args.pool_ratio,
                     "model": args.model or "SmolLM2-135M-Instruct"},
        "tier_off": off, "tier_on": on,
        "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
        "ttft_p90_speedup": off["ttft_p90_s"] / on["ttft_p90_s"],
        "throughput_speedup": on["tokens_per_s"] / off["tokens_per_s"],
        "recompute_ms_per_block": 1e3 * off["ttft_p50_s"] / prompt_blocks,
        "outputs_equal": off_out == on_out,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
