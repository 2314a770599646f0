"""The three sections of benchmarks/gpu_check.py: kernels, greedy, throughput.

Each case runs inside its own try/except and lands in the report as PASS, FAIL
(with the exception), SKIP or INFO, so one broken piece never hides the others.
`small=True` is the CPU smoke run: same code, tiny shapes.
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import torch

import gpu_harness as h

# Relative error max|a-e|/max|e| allowed, per output dtype.
ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ATTENTION_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# fp32 greedy may differ from HF only where HF's top two logits are closer than this.
NEAR_TIE = 1e-3


def describe_environment(device: torch.device) -> dict:
    import transformers

    env = dict(torch=torch.__version__, transformers=transformers.__version__, device=str(device))
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as exc:
        env["triton"] = f"missing ({exc})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        env.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                   free_gib=round(free / 2**30, 1), total_gib=round(total / 2**30, 1))
    return env


# ----------------------------------------------------------------------------- kernels
def _attention_cases(small: bool) -> list[tuple[str, list, int, int, int, torch.dtype]]:
    """(name, requests (cached, query) decodes first, heads, kv_heads, head_dim, dtype)."""
    contexts = (1, 17, 300, 1024, 2047, 4000, 4096, 2500)
    if small:
        decodes = [(c // 40, 1) for c in contexts]
        mixed = [(3, 1), (50, 1), (0, 7), (13, 5), (33, 25)]
        long_decode = [(400, 1)]
    else:
        decodes = [(c, 1) for c in contexts] * 4
        mixed = [(100, 1), (2000, 1), (0, 300), (512, 77), (33, 1000)]
        long_decode = [(16000, 1)]
    return [
        ("attention/decode_gqa4_d128", decodes, 32, 8, 128, torch.bfloat16),
        ("attention/decode_b1_long_ctx_splitk", long_decode, 32, 8, 128, torch.bfloat16),
        ("attention/mixed_gqa3_d64", mixed, 24, 8, 64, torch.bfloat16),
        ("attention/mixed_mha_d128", mixed, 16, 16, 128, torch.bfloat16),
        ("attention/mixed_gqa8_d64_fp32", mixed, 16, 2, 64, torch.float32),
    ]


def _check_attention(report, device, small: bool) -> None:
    from pagoda.kernels import reference as ref
    from pagoda.kernels.attention import paged_attention
    from pagoda.kernels.kv_cache import write_kv_cache
    from pagoda.kernels.testing import random_paged_batch, relative_error

    for name, requests, heads, kv_heads, dim, dtype in _attention_cases(small):
        try:
            b = random_paged_batch(requests, heads, kv_heads, dim, 16, dtype, device, seed=len(requests))
            md = b.attn_metadata
            write_kv_cache(b.key, b.value, b.key_cache, b.value_cache, md.slot_mapping)
            got = paged_attention(b.query, b.key_cache, b.value_cache, md, dim ** -0.5)
            want = ref.paged_attention(b.query, b.key_cache, b.value_cache, md, dim ** -0.5)
            err = relative_error(got, want)
            report.check("kernels", name, err, ATTENTION_TOL[dtype], err < ATTENTION_TOL[dtype],
                         f"{len(requests)} reqs, max ctx {md.max_seq_len}, {str(dtype)[6:]}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then the next case runs
            report.error("kernels", name, exc)


def _elementwise_cases(device, small: bool):
    """Yield (name, dtype, [(actual, expected), ...]) lazily, so one failure is one row."""
    from pagoda.kernels import reference as ref
    from pagoda.kernels.activation import silu_and_mul
    from pagoda.kernels.kv_cache import write_kv_cache
    from pagoda.kernels.rms_norm import rms_norm
    from pagoda.kernels.rotary import rotary_embedding

    tokens, hidden, inter, heads, dim = (37, 96, 80, 5, 32) if small else (4096, 4096, 14336, 40, 128)
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    for dtype in (torch.bfloat16, torch.float32):
        x, r, w = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype), randn(hidden, dtype=dtype)

        def rms(x=x, r=r, w=w):
            out, res = rms_norm(x, w, 1e-5, r)
            eout, eres = ref.rms_norm(x, w, 1e-5, r)
            return [(rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)), (out, eout), (res, eres)]

        def silu(dtype=dtype):
            gate_up = randn(tokens, 2 * inter, dtype=dtype) * 3
            return [(silu_and_mul(gate_up), ref.silu_and_mul(gate_up))]

        def rope(dtype=dtype):
            qk = randn(tokens, heads, dim, dtype=dtype)
            positions = torch.randint(0, 8192, (tokens,), generator=g, device=device)
            angles = torch.rand(8192, dim // 2, generator=g, device=device) * 6.3
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
            return [(rotary_embedding(qk, cos, sin, positions), ref.rotary_embedding(qk, cos, sin, positions)),
                    (rotary_embedding(qk, cos[positions], sin[positions]),
                     ref.rotary_embedding(qk, cos[positions], sin[positions]))]

        def kv_write(dtype=dtype):
            kv_heads, block = 8, 16
            k, v = randn(tokens, kv_heads, dim, dtype=dtype), randn(tokens, kv_heads, dim, dtype=dtype)
            num_blocks = tokens // block + 8
            slots = torch.randperm(num_blocks * block, generator=torch.Generator().manual_seed(0))[:tokens]
            slots = slots.to(device)
            caches = [randn(num_blocks, block, kv_heads, dim, dtype=dtype) for _ in range(2)]
            expected = [c.clone() for c in caches]
            write_kv_cache(k, v, *caches, slots)
            ref.write_kv_cache(k, v, *expected, slots)
            return list(zip(caches, expected))

        suffix = str(dtype)[6:]
        yield f"rms_norm(+residual)/{suffix}", dtype, rms
        yield f"silu_and_mul/{suffix}", dtype, silu
        yield f"rotary/{suffix}", dtype, rope
        yield f"write_kv_cache/{suffix}", dtype, kv_write


def check_kernels(report, device: torch.device, small: bool) -> None:
    from pagoda.kernels.testing import relative_error

    for name, dtype, run in _elementwise_cases(device, small):
        try:
            err = max(relative_error(a, e) for a, e in run())
            tol = 0.0 if name.startswith("write_kv_cache") else ELEMENTWISE_TOL[dtype]
            report.check("kernels", name, err, tol, err <= tol)
        except Exception as exc:  # noqa: BLE001
            report.error("kernels", name, exc)
    _check_attention(report, device, small)
    if device.type == "cuda":
        try:
            _time_decode_attention(report, device)
        except Exception as exc:  # noqa: BLE001
            report.error("kernels", "decode_attention_bandwidth", exc)


def _time_decode_attention(report, device) -> None:
    """Decode attention alone at batch 64 x 4096 context: K/V bytes read per second."""
    from pagoda.kernels.attention import paged_attention
    from pagoda.kernels.testing import random_paged_batch

    b = random_paged_batch([(4095, 1)] * 64, 32, 8, 128, 16, torch.bfloat16, device)
    md = b.attn_metadata
    for _ in range(3):
        paged_attention(b.query, b.key_cache, b.value_cache, md, 0.088)
    h.sync(device)
    iters, t = 20, time.perf_counter()
    for _ in range(iters):
        paged_attention(b.query, b.key_cache, b.value_cache, md, 0.088)
    h.sync(device)
    seconds = (time.perf_counter() - t) / iters
    kv_bytes = 2 * 64 * 4096 * 8 * 128 * 2
    report.check("kernels", "decode_attention_GBps(b64,ctx4k)", kv_bytes / seconds / 1e9, "-", None,
                 f"{seconds * 1e6:.0f} us per call incl. launch")


# ----------------------------------------------------------------------------- greedy
@contextlib.contextmanager
def count_attention_calls():
    """Counts calls of the Triton attention launcher (eager calls; graph replays run no Python)."""
    import pagoda.kernels.attention as kernel_module

    original = kernel_module.paged_attention
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    kernel_module.paged_attention = counting
    try:
        yield calls
    finally:
        kernel_module.paged_attention = original


def _random_prompts(lengths, vocab, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _agreement(outputs, expected) -> float:
    """Mean fraction of each output that equals the reference up to the first difference."""
    fractions = []
    for out, exp in zip(outputs, expected):
        same = next((i for i, (a, b) in enumerate(zip(out, exp)) if a != b), min(len(out), len(exp)))
        fractions.append(same / max(1, len(exp)))
    return sum(fractions) / max(1, len(fractions))


def _compare_greedy(hf, prompts, expected, outputs, device) -> tuple[int, bool, str]:
    """(exact matches, every difference is at a near-tie of HF's logits, detail)."""
    matches = sum(o == e for o, e in zip(outputs, expected))
    gaps = [h.divergence_gap(hf, p, e, o, device)
            for p, e, o in zip(prompts, expected, outputs) if o != e and len(o) == len(e)]
    ties_only = len(gaps) == len(prompts) - matches and all(g < NEAR_TIE for g in gaps)
    why = f"; HF logit margins where tokens differ: {[round(g, 6) for g in gaps]}" if gaps else ""
    return matches, ties_only, why


def check_greedy(report, device: torch.device, small: bool) -> None:
    lengths, max_tokens, chunk = ([3, 9, 20], 6, 8) if small else ([3, 17, 40, 64, 100, 129], 24, 32)
    spec = h.MODEL_SPECS["tiny"]
    prompts = _random_prompts(lengths, spec["vocab_size"])
    try:
        hf = h.build_hf_model(spec, torch.float32, device, init_range=0.1, norm_noise=0.2)
        expected = h.hf_greedy(hf, prompts, max_tokens, device)
    except Exception as exc:  # noqa: BLE001
        report.error("greedy", "hf_reference", exc)
        return
    for dtype in (torch.float32, torch.bfloat16):
        name = f"pagoda_vs_hf/{str(dtype)[6:]}"
        try:
            # The bf16 pair shares the same rounded weights: rebuilt from the same seed.
            hf_d = hf if dtype == torch.float32 else h.build_hf_model(
                spec, dtype, device, init_range=0.1, norm_noise=0.2)
            ref_outputs = expected if dtype == torch.float32 else h.hf_greedy(hf_d, prompts, max_tokens,
                                                                             device)
            ours = h.build_pagoda_model(hf_d, dtype, device)
            with count_attention_calls() as calls:
                outputs, replays = h.greedy_generate(ours, prompts, max_tokens, chunk, 16, device,
                                                     use_graphs=device.type == "cuda")
            detail = f"{replays} graph replays, {calls[0]} eager Triton attention calls"
            if dtype == torch.float32:
                matches, ties_only, why = _compare_greedy(hf, prompts, ref_outputs, outputs, device)
                ok = ties_only and calls[0] > 0 and (replays > 0 or device.type != "cuda")
                report.check("greedy", name, f"{matches}/{len(prompts)}", "all", ok, detail + why)
            else:  # bf16 rounding differs between any two implementations: informational
                report.check("greedy", name, _agreement(outputs, ref_outputs), "-", None,
                             "mean agreeing prefix fraction; " + detail)
        except Exception as exc:  # noqa: BLE001
            report.error("greedy", name, exc)
    _check_llm_end_to_end(report, hf, prompts, expected, max_tokens, device)


def _write_word_tokenizer(path: str, vocab_size: int, words: tuple[str, ...] = ()) -> None:
    """A word-level tokenizer "t0 t1 ..." so an HF directory loads with no download;
    `words` take the ids from 3 on (after unk/pad, bos, eos) in place of their "tN"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    for i, word in enumerate(words, start=3):
        del vocab[f"t{i}"]
        vocab[word] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(path)


def _check_llm_end_to_end(report, hf, prompts, expected, max_tokens, device) -> None:
    try:
        from pagoda import LLM, SamplingParams

        LLM.__name__  # noqa: B018 - resolves the lazy import (needs the whole engine + gguf)
    except Exception as exc:  # noqa: BLE001
        report.skip("greedy", "pagoda.LLM_vs_hf/float32", f"pagoda.LLM unavailable: {exc}")
        return
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hf.save_pretrained(tmp)
            _write_word_tokenizer(tmp, hf.config.vocab_size)
            llm = LLM(model=tmp, dtype="float32", device=device.type, max_model_len=512,
                      num_gpu_blocks_override=512)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            with count_attention_calls() as calls:
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            got = [list(o.outputs[0].token_ids) for o in outs]
            matches, ties_only, why = _compare_greedy(hf, prompts, expected, got, device)
            ok = ties_only and (calls[0] > 0 or device.type != "cuda")
            report.check("greedy", "pagoda.LLM_vs_hf/float32", f"{matches}/{len(prompts)}", "all", ok,
                         f"{calls[0]} eager Triton attention calls{why}")
            del llm
    except Exception as exc:  # noqa: BLE001
        report.error("greedy", "pagoda.LLM_vs_hf/float32", exc)


# ----------------------------------------------------------------------------- throughput
SECONDS_NEEDED = {"1b": 100, "8b": 200, "tiny": 5}


def check_throughput(report, device: torch.device, args, deadline: float, small: bool) -> None:
    try:
        bandwidth = h.copy_bandwidth(device)
    except Exception as exc:  # noqa: BLE001
        report.error("throughput", "copy_bandwidth", exc)
        return
    report.notes.append(f"measured device copy bandwidth {bandwidth / 1e12:.3f} TB/s (read + write)")
    names = ["tiny"] if small else [m.strip() for m in args.models.split(",") if m.strip()]
    for name in names:
        left = deadline - time.monotonic()
        if name not in h.MODEL_SPECS:
            report.skip("throughput", name, f"unknown model; choose from {sorted(h.MODEL_SPECS)}")
            continue
        if left < SECONDS_NEEDED[name]:
            report.skip("throughput", name, f"{left:.0f}s of the budget left, ~{SECONDS_NEEDED[name]}s needed")
            continue
        try:
            _throughput_model(report, device, args, name, bandwidth, deadline, small)
        except Exception as exc:  # noqa: BLE001
            report.error("throughput", name, exc)
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _throughput_model(report, device, args, name, bandwidth, deadline, small) -> None:
    dtype = torch.bfloat16
    hf = h.build_hf_model(h.MODEL_SPECS[name], dtype, device)
    ours = h.build_pagoda_model(hf, dtype, device)
    if args.no_hf:
        del hf
        hf = None
    batches = [1, 4] if small else sorted(int(b) for b in args.batch_sizes.split(","))
    prompt_len, steps, warmup, block = (8, 3, 1, 16) if small else (args.prompt_len, args.decode_steps, 3, 16)
    max_len = prompt_len + warmup + steps + 2
    max_blocks = -(-max_len // block)
    kv = h.allocate_kv(ours.arch, max(batches) * max_blocks, block, dtype, device)
    t = time.monotonic()
    graphs = (h.make_graphs(ours, kv, batches, max_blocks, max_len, device)
              if device.type == "cuda" else None)
    report.notes.append(f"{name}: {sum(p.numel() for p in ours.parameters()) / 1e9:.2f}B parameters; "
                        f"graph capture for {batches} took {time.monotonic() - t:.1f}s")
    mean_context = prompt_len + warmup + steps / 2
    for batch in batches:
        if time.monotonic() > deadline:
            report.skip("throughput", f"{name}/batch{batch}", "time budget spent")
            continue
        row = dict(model=name, batch=batch)
        timing = dict(batch=batch, prompt_len=prompt_len, steps=steps, warmup=warmup,
                      block_size=block, max_blocks=max_blocks, device=device)
        if graphs is not None:
            row["graphs"] = h.time_decode(ours, kv, graphs, **timing)
        eager_wanted = graphs is None or not args.no_eager  # one figure at least
        if eager_wanted and (name != "8b" or deadline - time.monotonic() > 90):
            row["eager"] = h.time_decode(ours, kv, None, **timing)
        if hf is not None and deadline - time.monotonic() > 45:
            row["hf"] = h.time_hf_decode(hf, batch, prompt_len, steps, device)
        row["roofline"] = batch * bandwidth / h.decode_bytes_per_step(ours, batch, mean_context)
        best = row.get("graphs") or row.get("eager")
        row["pct_roofline"] = 100 * best / row["roofline"]
        if row.get("hf"):
            row["speedup_vs_hf"] = best / row["hf"]
        report.throughput.append(row)
        print("throughput:", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
    del graphs, kv, ours, hf
