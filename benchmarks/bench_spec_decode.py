"""Single-stream decode with and without n-gram speculation, beside llama.cpp (not a pytest file).

    .venv/bin/python benchmarks/bench_spec_decode.py [--k 4] [--max-tokens 128] [--llamacpp-bin DIR]

One request at a time, greedy, `--max-tokens` out, on prompts whose answers repeat their
context (rewrite a list, continue a sequence, edit code): the case prompt lookup is for.
For each prompt it times the plain engine and the engine with
`{"method": "ngram", "num_speculative_tokens": k, ...}` on the same weights, alternating,
reports how far both produced the same tokens (all of them in fp32; bf16 may flip a
near-tie), and decode tokens/s (output tokens over
the request's time, prefill included), the mean acceptance length and the ratio. With a
llama.cpp build (benchmarks/build_llamacpp.sh; `--llamacpp-bin` its bin folder) it also
runs `llama-bench -p 0 -n 128 -t 2` (llama.cpp's decode without speculation) in the same
sitting. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import time

PROMPTS = [
    "Repeat this list exactly, one item per line:\napple\nbanana\ncherry\ndate\nelderberry\n"
    "fig\ngrape\nhoneydew\nkiwi\nlemon\nmango\nnectarine\norange\npapaya",
    "Rewrite this Python function with type hints, keeping everything else the same:\n\n"
    "def total(items, tax):\n    result = 0\n    for item in items:\n        result += "
    "item.price * item.quantity\n    result = result * (1 + tax)\n    return round(result, 2)\n",
    "Continue the sequence: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, "
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday,",
    "Copy the following sentence three times: The quick brown fox jumps over the lazy dog "
    "near the river bank.",
]
SPEC = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def run(llm, prompt: str, max_tokens: int) -> tuple[float, list[int]]:
    from pagoda import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    messages = [{"role": "user", "content": prompt}]
    start = time.perf_counter()
    out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    return time.perf_counter() - start, list(out.token_ids)


def llama_bench(bin_dir: str, gguf: str) -> float | None:
    binary = pathlib.Path(bin_dir) / "llama-bench"
    if not binary.exists():
        return None
    out = subprocess.run([str(binary), "-m", gguf, "-t", "2", "-p", "0", "-n", "128", "-o",
                          "json"], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout)[0]["avg_ts"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--llamacpp-bin", default=os.path.expanduser(
        "~/.cache/pagoda/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"))
    args = parser.parse_args()
    from pagoda import LLM
    from pagoda.model.loader import default_model_path

    plain = LLM(max_model_len=2048, dtype=args.dtype)
    spec = LLM(max_model_len=2048, dtype=args.dtype,
               speculative_config={**SPEC, "num_speculative_tokens": args.k})
    rows = []
    for prompt in PROMPTS:
        run(plain, prompt, 8), run(spec, prompt, 8)  # warm-up
        times = {"plain": [], "ngram": []}
        stats = spec.llm_engine.core.get_stats().spec_decoding
        drafts0, accepted0 = stats.num_drafts, stats.num_accepted_tokens
        for _ in range(args.repeats):
            for name, llm in (("plain", plain), ("ngram", spec)):
                seconds, tokens = run(llm, prompt, args.max_tokens)
                times[name].append(seconds)
                if name == "plain":
                    expected = tokens
                else:
                    same = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b),
                                len(tokens))
        stats = spec.llm_engine.core.get_stats().spec_decoding
        drafts = stats.num_drafts - drafts0
        rows.append({"prompt": prompt[:48],
                     "plain_tok_s": round(args.max_tokens / min(times["plain"]), 1),
                     "ngram_tok_s": round(args.max_tokens / min(times["ngram"]), 1),
                     # bf16 rounds a 5-row verify step differently from a 1-row decode,
                     # so a near-tie may flip (fp32 or --batch-invariant: always equal).
                     "tokens_equal_until": same,
                     "mean_acceptance_length": round(
                         1 + (stats.num_accepted_tokens - accepted0) / max(drafts, 1), 2)})
    plain_mean = sum(r["plain_tok_s"] for r in rows) / len(rows)
    ngram_mean = sum(r["ngram_tok_s"] for r in rows) / len(rows)
    llama = llama_bench(args.llamacpp_bin, default_model_path())
    print(json.dumps({
        "metric": f"single-stream greedy decode tokens/s ({args.max_tokens} out, chat prompts "
                  "that repeat their context; best of repeats)",
        "k": args.k, "rows": rows, "pagoda_plain_mean": round(plain_mean, 1),
        "pagoda_ngram_mean": round(ngram_mean, 1),
        "speedup": round(ngram_mean / plain_mean, 2),
        "llamacpp_tg128": round(llama, 1) if llama else None,
        "ratio_plain_vs_llamacpp": round(plain_mean / llama, 3) if llama else None,
        "ratio_ngram_vs_llamacpp": round(ngram_mean / llama, 3) if llama else None,
        "loadavg_1m_before": os.getloadavg()[0]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
