"""KV cache tiers: a multi-turn workload whose revisited prefixes are ~4x the device
KV pool, with tiers off, the host tier (--kv-offloading-size) and the disk tier below a
host tier too small for one context (--kv-offloading-disk-path/-size); not a pytest file.

    .venv/bin/python benchmarks/bench_kv_tiers.py [--model M] [--prefix-len 2048]
        [--conversations 8] [--rounds 3] [--pool-ratio 4] [--tier-gib 2]
        [--disk-gib 2] [--disk-path /tmp] [--disk-host-blocks 8]

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
    disk           per block read from disk and copied to the device (file read, header
                   and CRC-32 checks included), and written to disk; the read bandwidth
    projection     the same copies on a GPU host from the measured disk bandwidth and an
                   assumed PCIe link, against a recompute at an assumed GPU throughput
                   (the assumptions are printed with the figures)

The disk run's directory is a fresh one under --disk-path (the OS page cache is not
dropped: a revisit may read from memory, as it would on a host with free RAM). The
outputs of every run are compared token for token (they must be equal). Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
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


# Projection assumptions (not measured here): a PCIe 5.0 x16 link's practical
# host-to-device rate, and a GPU's sustained dense bf16 throughput on a prefill.
PCIE_GB_S = 25.0
GPU_TFLOPS = 400.0


def run(args, prompts, tier_gib: float, disk_path: str | None = None) -> dict:
    from pagoda import SamplingParams
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    # A quarter of the contexts (--pool-ratio 4), at least room for one request.
    pool_tokens = max(args.conversations * args.prefix_len // args.pool_ratio,
                      args.prefix_len + TURN * args.rounds + MAX_TOKENS + 2 * BLOCK)
    engine = LLMEngine(EngineArgs(
        model=args.model, max_model_len=args.prefix_len + TURN * args.rounds + MAX_TOKENS + 64,
        block_size=BLOCK, num_gpu_blocks_override=pool_tokens // BLOCK,
        kv_offloading_size=tier_gib or None, kv_offloading_disk_path=disk_path,
        kv_offloading_disk_size=args.disk_gib if disk_path else None))
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
        if tier.disk is not None:
            d = tier.disk.stats
            result.update({
                "disk_records": tier.disk.num_records, "disk_read_blocks": d.read_blocks,
                "disk_written_blocks": d.written_blocks, "disk_failed_reads": d.failed_reads,
                "disk_failed_writes": d.failed_writes,
                "disk_onload_ms_per_block": 1e3 * d.read_seconds / max(d.read_blocks, 1),
                "disk_write_ms_per_block": 1e3 * d.write_seconds / max(d.written_blocks, 1),
                "disk_read_gb_s": d.read_bytes / max(d.read_seconds, 1e-9) / 1e9})
    result["num_params"] = sum(p.numel() for p in runner.model.parameters())
    engine.core.shutdown()
    return result, outputs


def projection(block_bytes: int, num_params: int, disk_gb_s: float) -> dict:
    """Per block on a GPU host: the disk and host copies at the measured disk rate and
    an assumed PCIe rate, against a recompute at an assumed throughput (2 FLOPs per
    parameter per token, attention left out: it flatters recompute)."""
    pcie_ms = 1e3 * block_bytes / (PCIE_GB_S * 1e9)
    return {"assumed_pcie_gb_s": PCIE_GB_S, "assumed_gpu_tflops": GPU_TFLOPS,
            "host_onload_ms_per_block": pcie_ms,
            "disk_onload_ms_per_block": pcie_ms + 1e3 * block_bytes / (disk_gb_s * 1e9),
            "recompute_ms_per_block": 1e3 * 2 * num_params * BLOCK / (GPU_TFLOPS * 1e12)}


def _block_bytes(args) -> int:
    """One whole KV block of the model, as the tiers size it."""
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.worker.host_kv_tier import host_tier_slots

    config = EngineArgs(model=args.model, block_size=BLOCK, kv_offloading_size=1.0,
                        max_model_len=args.prefix_len + 1024).create_engine_config()
    return host_tier_slots(config)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pool-ratio", type=int, default=4)
    parser.add_argument("--tier-gib", type=float, default=2.0)
    parser.add_argument("--disk-gib", type=float, default=2.0)
    parser.add_argument("--disk-path", default=tempfile.gettempdir())
    parser.add_argument("--disk-host-blocks", type=int, default=8,
                        help="the host tier above the disk in the disk run, in blocks")
    parser.add_argument("--skip", nargs="*", default=[], choices=["off", "host", "disk"])
    args = parser.parse_args()
    prompts = workload(args)
    off, off_out = run(args, prompts, 0.0) if "off" not in args.skip else (None, None)
    on, on_out = run(args, prompts, args.tier_gib) if "host" not in args.skip else (None, None)
    disk, disk_out = None, None
    if "disk" not in args.skip:
        directory = tempfile.mkdtemp(prefix="pagoda-kv-disk-", dir=args.disk_path)
        try:
            block_bytes = _block_bytes(args)
            disk, disk_out = run(args, prompts, args.disk_host_blocks * block_bytes / 2 ** 30,
                                 directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    prompt_blocks = (args.prefix_len + TURN * 2) / BLOCK
    report = {
        "workload": {"prefix_len": args.prefix_len, "conversations": args.conversations,
                     "rounds": args.rounds, "working_set_over_pool": args.pool_ratio,
                     "model": args.model or "SmolLM2-135M-Instruct"},
        "tier_off": off, "tier_on": on, "disk_tier": disk,
    }
    outputs = [o for o in (off_out, on_out, disk_out) if o is not None]
    report["outputs_equal"] = all(o == outputs[0] for o in outputs)
    if off is not None:
        report["recompute_ms_per_block"] = 1e3 * off["ttft_p50_s"] / prompt_blocks
        for name, run_ in (("host", on), ("disk", disk)):
            if run_ is not None:
                report[f"{name}_ttft_p50_speedup"] = off["ttft_p50_s"] / run_["ttft_p50_s"]
                report[f"{name}_ttft_p90_speedup"] = off["ttft_p90_s"] / run_["ttft_p90_s"]
                report[f"{name}_throughput_speedup"] = run_["tokens_per_s"] / off["tokens_per_s"]
    if disk is not None and disk.get("disk_read_blocks"):
        report["gpu_projection"] = projection(disk["block_bytes"], disk["num_params"],
                                              disk["disk_read_gb_s"])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
