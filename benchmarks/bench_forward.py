"""Times our forward on SmolLM2: a decode step and a prefill step (not a pytest file).

    .venv/bin/python benchmarks/bench_forward.py [--dtype bfloat16] [--profile] [--threads N]
    .venv/bin/python benchmarks/bench_forward.py --matmul   # bf16 vs fp32 matmul speed

Decode: 64 requests with ~200-token contexts, one token each. Prefill: one 2048-token
request, and 16 requests of 128 tokens (what `make bench` schedules per step).
Blocks are spread at random over the cache, as after some serving.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagoda.model.attention_metadata import AttentionMetadata
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.loader import load_arch_config, load_model, resolve_dtype, resolve_model_path

BLOCK_SIZE = 16


def make_step(contexts: list[int], query_lens: list[int], num_blocks: int, vocab: int):
    """Flattened inputs for requests with `contexts[i]` cached tokens and `query_lens[i]` new."""
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    slots, positions, tables, qsl, seq_lens = [], [], [], [0], []
    for ctx, n in zip(contexts, query_lens):
        blocks = [free.pop() for _ in range(-(-(ctx + n) // BLOCK_SIZE))]
        positions += range(ctx, ctx + n)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx, ctx + n)]
        tables.append(blocks)
        qsl.append(qsl[-1] + n)
        seq_lens.append(ctx + n)
    width = max(map(len, tables))
    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=sum(1 for n in query_lens if n == 1), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens)
    ids = torch.randint(0, vocab, (len(slots),))
    return ids, torch.tensor(positions), md


def time_step(model, kv_caches, step, repeats: int) -> tuple[float, float]:
    """Fastest (wall seconds, process CPU seconds) of `repeats` steps. On a shared
    machine the minimum and the CPU time are the steadier figures: wall time also
    counts waiting for a core."""
    ids, positions, md = step
    walls, cpus = [], []
    with torch.inference_mode():
        model(ids, positions, kv_caches, md)  # warm-up
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            model(ids, positions, kv_caches, md)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def compare_matmul_dtypes() -> None:
    """The measurement behind resolve_dtype("auto"): a SmolLM2-sized matmul (256 rows x
    576 x 576) in fp32 and bf16, best of 30 x 20 calls."""
    x, w = torch.randn(256, 576), torch.randn(576, 576)
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        xd, wd = x.to(dtype), w.to(dtype)
        for _ in range(20):
            torch.nn.functional.linear(xd, wd)
        times = []
        for _ in range(30):
            start = time.perf_counter()
            for _ in range(20):
                torch.nn.functional.linear(xd, wd)
            times.append((time.perf_counter() - start) / 20)
        best[dtype] = min(times)
    ratio = best[torch.bfloat16] / best[torch.float32]
    print(f"threads={torch.get_num_threads()} fp32 {best[torch.float32] * 1e6:.0f} us  "
          f"bf16 {best[torch.bfloat16] * 1e6:.0f} us  bf16/fp32 time {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", default=None, help="run the steps whose name contains this")
    parser.add_argument("--matmul", action="store_true", help="only compare matmul dtypes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.matmul:
        compare_matmul_dtypes()
        return
    path = resolve_model_path(args.model)
    arch = load_arch_config(path)
    dtype = resolve_dtype(args.dtype, "cpu")
    model = load_model(path, arch, dtype)
    kv_caches = allocate_kv_caches(arch, 2048, BLOCK_SIZE, dtype, "cpu")
    rng = random.Random(1)
    steps = {
        "decode 64 x ~200 ctx": make_step([rng.randint(180, 220) for _ in range(64)], [1] * 64,
                                          2048, arch.vocab_size),
        "prefill 1 x 2048": make_step([0], [2048], 2048, arch.vocab_size),
        "prefill 16 x 128": make_step([0] * 16, [128] * 16, 2048, arch.vocab_size),
    }
    print(f"dtype={dtype} threads={torch.get_num_threads()}")
    for name, step in steps.items():
        if args.only and args.only not in name:
            continue
        repeats = 10 if name.startswith("decode") else 3
        wall, cpu = time_step(model, kv_caches, step, repeats)
        print(f"{name:24s} wall {wall * 1e3:8.1f} ms   cpu {cpu * 1e3:8.1f} ms")
        if args.profile:
            with torch.profiler.profile() as prof, torch.inference_mode():
                model(step[0], step[1], kv_caches, step[2])
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
