"""Parity of an architecture with transformers on a tiny random checkpoint.

`save_tiny_checkpoint` builds the model with transformers' own config class and random
weights (a large init range and random norm weights, so every layer visibly changes
the logits), saved as safetensors with SmolLM2's tokenizer: it loads like any HF
directory. `assert_matches_transformers` runs the same prompts (token ids, so no
tokenizer question arises) through HF `generate` and through `pagoda.LLM` with
prefix caching on, chunked prefill forced by a small token budget and small blocks,
then once more so the second pass starts from prefix-cache hits: greedy tokens must
be equal and the chosen tokens' logprobs within `LOGPROB_ATOL`.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from pagoda import LLM, SamplingParams

# fp32 on both sides; the two differ only in summation order (paged vs dense attention,
# fused projections), which moves a logprob by ~1e-6 on these tiny models.
LOGPROB_ATOL = 1e-4
ENGINE = dict(dtype="float32", enable_prefix_caching=True, block_size=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=256)


# The model's vocabulary: SmolLM2's tokenizer has 49152 tokens, but prompts are token
# ids and a small LM head keeps the tests fast; generated ids still detokenize.
VOCAB_SIZE = 512


def random_prompts(lengths: list[int], vocab_size: int = VOCAB_SIZE,
                   seed: int = 0) -> list[list[int]]:
    """Random token prompts, plus one that extends the first by 5 tokens so the batch
    itself shares a prefix."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[0] + prompts[-1][:5])
    return prompts


def save_tiny_checkpoint(path, config, tokenizer, seed: int = 0) -> str:
    config.initializer_range = 0.2
    config.eos_token_id = None  # generation never stops early on either side
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: int):
    """[(tokens, logprob of each)] from transformers' eager attention, fp32."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    results = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        tokens = out.sequences[0, len(ids):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens)]
        results.append((tokens, logprobs))
    return results


def pagoda_greedy(llm: LLM, prompts: list[list[int]], max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outputs:
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [lp[t].logprob for lp, t in zip(completion.logprobs, tokens)]))
    return results, outputs


def assert_same(ours, reference) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, reference, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=LOGPROB_ATOL, rtol=0)


def assert_matches_transformers(path: str, prompts: list[list[int]], max_tokens: int,
                                **engine_overrides) -> LLM:
    """Greedy tokens equal and logprobs close, cold and again from prefix-cache hits.
    Returns the engine (for further checks)."""
    reference = hf_greedy(path, prompts, max_tokens)
    llm = LLM(model=path, **{**ENGINE, **engine_overrides})
    cold, _ = pagoda_greedy(llm, prompts, max_tokens)
    assert_same(cold, reference)
    warm, outputs = pagoda_greedy(llm, prompts, max_tokens)
    assert_same(warm, reference)
    if llm.llm_engine.config.cache.enable_prefix_caching:
        assert all(o.num_cached_tokens > 0 for o in outputs)
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
    return llm


def cache_runner(path: str, num_blocks: int = 4, block_size: int = 16):
    """One rank's model runner as the KV transfer code reads it
    (kv_transfer.block_shares.runner_geometry, runner_share): the checkpoint's
    architecture, its KV caches allocated in float32, no parallelism."""
    from types import SimpleNamespace  # lazy: this helper only

    from pagoda.distributed.parallel_state import SINGLE
    from pagoda.model.kv_cache import allocate_kv_caches
    from pagoda.model.loader import load_arch_config

    arch = load_arch_config(path)
    return SimpleNamespace(config=SimpleNamespace(arch=arch), parallel=SINGLE,
                           block_size=block_size, kv_cache_dtype=torch.float32,
                           kv_caches=allocate_kv_caches(arch, num_blocks, block_size,
                                                        torch.float32, "cpu"))
