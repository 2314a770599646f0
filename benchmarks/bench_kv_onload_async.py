"""Asynchronous vs synchronous onload from the KV tiers (--kv-offloading-onload): long
prefixes come back from the host or disk tier while other requests decode; not a
pytest file.

    .venv/bin/python benchmarks/bench_kv_onload_async.py [--model M] [--prefix-len 1024]
        [--contexts 6] [--streams 4] [--gap 6] [--modes host-sync host-async ...]
        [--repeat 1]

Per run (one engine, in-process, stepped by this script):
  1. warm-up: each of `contexts` random `prefix-len`-token contexts is sent once
     (max_tokens 1, one at a time); the device pool holds the decoders and one of them,
     so the others are evicted into the tier (host tier: 2 GiB; disk: an 8-block host
     tier over a 2 GiB disk tier in a fresh directory, OS page cache not dropped);
  2. measured: `streams` short requests decode greedily; every `gap` steps one context
     comes back with a new 16-token turn (max_tokens 4) while they decode, until every
     context came back once; then the decoders are aborted.

Reported per run: the decoders' inter-token latency (the wall time between two tokens
of one stream, every stream, every step of phase 2) p50/p90/p99/max; the revisits' TTFT
(add_request to the step that returned the first token) p50/max; the onloaded blocks and
the scheduler's onload waits; the load average before and after. Modes run back to
back in the order given, `repeat` times. The outputs of each mode's runs (revisits and
decoders) are compared with the first run's: `outputs_equal`. The modes put a revisit's
prefill in different steps, so the decoders share steps with different requests: with
fp32 CPU kernels that are not batch-invariant a near-tie may flip; `--batch-invariant`
takes that away (then any mismatch is a bug). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

BLOCK = 16
TURN = 16
MODES = ("host-sync", "host-async", "disk-sync", "disk-async")


def _q(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(args, mode: str, contexts, turns, stream_prompts) -> tuple[dict, dict]:
    from pagoda import SamplingParams
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine
    from pagoda.messages import EngineCoreRequest
    from pagoda.worker.host_kv_tier import host_tier_slots

    tier, onload = mode.split("-")
    max_len = args.prefix_len + TURN + 64
    # Room for the decoders and one revisit: every earlier context is evicted to the tier.
    pool_blocks = (args.prefix_len + TURN + 64 + args.streams * (64 + args.stream_tokens)) \
        // BLOCK + 8
    directory = None
    extra = {"kv_offloading_size": 2.0}
    if tier == "disk":
        directory = tempfile.mkdtemp(prefix="pagoda-kv-onload-", dir=args.disk_path)
        probe = EngineArgs(model=args.model, block_size=BLOCK, kv_offloading_size=1.0,
                           max_model_len=max(max_len, args.stream_tokens + 128))
        block_bytes = host_tier_slots(probe.create_engine_config())[1]
        extra = {"kv_offloading_size": 8 * block_bytes / 2 ** 30,
                 "kv_offloading_disk_path": directory, "kv_offloading_disk_size": 2.0}
    engine = LLMEngine(EngineArgs(
        model=args.model, max_model_len=max(max_len, args.stream_tokens + 128),
        block_size=BLOCK, num_gpu_blocks_override=pool_blocks, kv_offloading_onload=onload,
        max_num_batched_tokens=2048, batch_invariant=args.batch_invariant or None, **extra))
    core = engine.core
    try:
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for i, ctx in enumerate(contexts):  # 1. warm-up: into the tier
            core.add_request(EngineCoreRequest(f"warm{i}", ctx, one))
            while core.has_unfinished_requests():
                core.step()
        decode = SamplingParams(temperature=0.0, max_tokens=args.stream_tokens, ignore_eos=True)
        revisit = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        tokens: dict[str, list[int]] = {}
        last_token_at: dict[str, float] = {}
        itl: list[float] = []
        added: dict[str, float] = {}
        ttft: dict[str, float] = {}
        for i, prompt in enumerate(stream_prompts):
            core.add_request(EngineCoreRequest(f"stream{i}", prompt, decode))
            tokens[f"stream{i}"] = []
        for _ in range(3):  # the decoders' prefills
            core.step()
        start_blocks = core.executor.runner.host_tier.stats.onloaded_blocks
        next_ctx, step = 0, 0
        load_before = os.getloadavg()[0]
        while next_ctx < len(contexts) or any(r.startswith("revisit") for r in core.scheduler.requests):
            if next_ctx < len(contexts) and step % args.gap == 0:
                rid = f"revisit{next_ctx}"
                core.add_request(EngineCoreRequest(rid, contexts[next_ctx] + turns[next_ctx],
                                                   revisit))
                tokens[rid] = []
                added[rid] = time.perf_counter()
                next_ctx += 1
            outs = core.step()
            now = time.perf_counter()
            step += 1
            for out in outs:
                rid = out.request_id
                if rid not in tokens or not out.new_token_ids:
                    continue
                tokens[rid] += out.new_token_ids
                if rid.startswith("stream"):
                    if rid in last_token_at:
                        itl.append(now - last_token_at[rid])
                    last_token_at[rid] = now
                elif rid not in ttft:
                    ttft[rid] = now - added[rid]
            if step > 100000:
                raise RuntimeError("the run did not end")
        load_after = os.getloadavg()[0]
        core.abort_requests([r for r in tokens if r.startswith("stream")])
        while core.has_unfinished_requests():
            core.step()
        host = core.executor.runner.host_tier
        result = {
            "decode_itl_p50_ms": 1e3 * _q(itl, 0.5), "decode_itl_p90_ms": 1e3 * _q(itl, 0.9),
            "decode_itl_p99_ms": 1e3 * _q(itl, 0.99), "decode_itl_max_ms": 1e3 * max(itl),
            "decode_itl_samples": len(itl),
            "revisit_ttft_p50_ms": 1e3 * statistics.median(ttft.values()),
            "revisit_ttft_max_ms": 1e3 * max(ttft.values()),
            "onloaded_blocks": host.stats.onloaded_blocks - start_blocks
            + (host.disk.stats.read_blocks if host.disk is not None else 0),
            "failed_onloads": host.stats.failed_onloads,
            "onload_waits": core.scheduler.num_onload_waits,
            "steps": step, "load_avg_1m_before": load_before, "load_avg_1m_after": load_after,
        }
        outputs = {r: t for r, t in tokens.items()}
        return result, outputs
    finally:
        core.shutdown()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--contexts", type=int, default=6)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--gap", type=int, default=6, help="steps between two revisits")
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--disk-path", default=tempfile.gettempdir())
    parser.add_argument("--batch-invariant", action="store_true",
                        help="batch-invariant kernels: outputs independent of which "
                             "requests share a step (sync and async batch differently)")
    args = parser.parse_args()
    rng = random.Random(0)
    contexts = [[1] + [rng.randrange(100, 40000) for _ in range(args.prefix_len - 1)]
                for _ in range(args.contexts)]
    turns = [[rng.randrange(100, 40000) for _ in range(TURN)] for _ in range(args.contexts)]
    streams = [[1] + [rng.randrange(100, 40000) for _ in range(63)] for _ in range(args.streams)]
    runs, reference, mismatches = [], None, []
    for _ in range(args.repeat):
        for mode in args.modes:
            result, outputs = run(args, mode, contexts, turns, streams)
            # The decoders were aborted after different numbers of steps: compare the
            # common part of each stream, and the revisits whole.
            if reference is None:
                reference = outputs
            for rid, toks in outputs.items():
                ref = reference[rid]
                n = min(len(ref), len(toks)) if rid.startswith("stream") else None
                if toks[:n] != ref[:n]:
                    mismatches.append(f"{mode}:{rid}@{next(i for i, (a, b) in enumerate(zip(toks, ref)) if a != b)}")
            runs.append({"mode": mode, **result})
            print(json.dumps(runs[-1]), flush=True)
    print(json.dumps({"workload": {"prefix_len": args.prefix_len, "contexts": args.contexts,
                                   "streams": args.streams, "gap_steps": args.gap,
                                   "model": args.model or "SmolLM2-135M-Instruct"},
                      "runs": runs, "outputs_equal": not mismatches,
                      "mismatches (mode:request@first differing token)": mismatches},
                     indent=2))


if __name__ == "__main__":
    main()
