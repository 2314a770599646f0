"""Micro-benchmark of the sampler at a decode-step shape (not collected by pytest).

    .venv/bin/python benchmarks/bench_sampler.py [--batch 64] [--vocab 49152] [--device cpu]
        [--threads N]

Prints the wall time of metadata building (median) and of one sampler call (median
and min) for a few batch compositions. Logits are synthetic: N(0, 1) x scale, "peaky" (scale 5: the top
few tokens hold most of the mass, like a real LM) and "flat" (scale 1: top-p has to
look at thousands of tokens, the worst case).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagoda.sample.builder import build_sampling_metadata, make_generator
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams as SP


def _mixed(i: int) -> SP:
    """Half greedy, half random; some seeded, some penalised, some with logprobs."""
    if i % 2 == 0:
        return SP(temperature=0.0, logprobs=5 if i % 8 == 0 else None)
    return SP(temperature=0.8, top_p=0.95, top_k=50, seed=i if i % 4 == 1 else None,
              repetition_penalty=1.1 if i % 8 == 3 else 1.0)


SCENARIOS = {
    "greedy": lambda i: SP(temperature=0.0),
    "greedy+logprobs5": lambda i: SP(temperature=0.0, logprobs=5),
    "random T=1": lambda i: SP(temperature=1.0),
    "random top_p=0.9": lambda i: SP(temperature=1.0, top_p=0.9),
    "random top_k=50": lambda i: SP(temperature=1.0, top_k=50),
    "mixed": _mixed,
}


def _timings_ms(fn, repeats: int) -> tuple[float, float]:
    """(median, min): on a shared machine the min is the steadier figure."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batch, vocab, device = args.batch, args.vocab, args.device
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (512,), generator=gen).tolist() for _ in range(batch)]
    outputs = [torch.randint(0, vocab, (128,), generator=gen).tolist() for _ in range(batch)]
    eos = [[2]] * batch
    sampler = Sampler()
    print(f"B={batch} V={vocab} device={device} threads={torch.get_num_threads()}")
    for name, make in SCENARIOS.items():
        params = [make(i) for i in range(batch)]
        generators = {i: make_generator(p.seed, device) for i, p in enumerate(params)
                      if p.seed is not None}

        def build():
            return build_sampling_metadata(params, prompts, outputs, generators, vocab, eos,
                                           device=device)

        md = build()
        build_ms, _ = _timings_ms(build, args.repeats)
        for label, scale in (("peaky", 5.0), ("flat", 1.0)):
            logits = (torch.randn(batch, vocab, generator=gen) * scale).to(device)
            median, fastest = _timings_ms(lambda: sampler(logits, md), args.repeats)
            print(f"  {name:18s} {label:5s}  build {build_ms:5.2f} ms  "
                  f"sample median {median:7.2f} ms  min {fastest:7.2f} ms")


if __name__ == "__main__":
    main()
