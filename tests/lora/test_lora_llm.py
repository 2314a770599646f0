"""LLM.generate with LoRA adapters against HF transformers + peft (greedy token ids)."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import LlamaForCausalLM

from pagoda import LLM, LoRARequest, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def hf_greedy(base_dir: str, adapter_dir: str | None, prompt_ids: list[int]) -> list[int]:
    model = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", block_size=4, max_model_len=256,
               enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3)


def lora(adapters, i: int) -> LoRARequest:
    return LoRARequest(f"adapter{i}", i + 1, adapters[i])


def ids_of(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_adapter_output_equals_hf_peft(llm, adapters, tiny_llama_dir):
    prompt_ids = llm.get_tokenizer().encode(PROMPTS[0])
    for i in range(3):
        got = ids_of(llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY, use_tqdm=False,
                                  lora_request=lora(adapters, i)))[0]
        assert got == hf_greedy(tiny_llama_dir, adapters[i], prompt_ids), f"adapter {i}"
    base = ids_of(llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY, use_tqdm=False))[0]
    assert base == hf_greedy(tiny_llama_dir, None, prompt_ids)
    # The adapters do change the output (else the comparison above proves nothing).
    adapted = ids_of(llm.generate([{"prompt_token_ids": prompt_ids}], GREEDY, use_tqdm=False,
                                  lora_request=lora(adapters, 0)))[0]
    assert adapted != base


def test_mixed_batch_equals_single_adapter_runs(llm, adapters):
    """Base rows and two adapters in one step; each row equals its own run alone.
    With max_loras=2 and three adapters the scheduler must split the steps."""
    requests = [lora(adapters, 0), None, lora(adapters, 1), lora(adapters, 2)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    mixed = ids_of(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests))
    for prompt, request, got in zip(prompts, requests, mixed):
        alone = ids_of(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=request))[0]
        assert got == alone
    assert mixed[0] != mixed[3]  # same prompt, different adapters


def test_no_prefix_hit_across_adapters(llm, adapters):
    prompt = "A long shared prompt that fills several cache blocks of four tokens each"
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora(adapters, 0))[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora(adapters, 0))[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora(adapters, 1))[0]
    base = llm.generate([prompt + " x"], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the same adapter does hit
    assert other.num_cached_tokens == 0
    assert base.num_cached_tokens == 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_lora_request_without_enable_lora_is_refused(tiny_llama_dir, adapters):
    plain = LLM(tiny_llama_dir, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="not enabled"):
        plain.generate(["hi"], GREEDY, use_tqdm=False, lora_request=lora(adapters, 0))
