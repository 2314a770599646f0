"""A decode step's layers in one C++ call: bit-equal to the Python loop, only where it applies."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.quantization import gguf_int4

pytestmark = pytest.mark.skipif(
    not (gguf_int4.available() and cpu_kernels.available()),
    reason="torch without int4 CPU mm, or the CPU kernels did not build")


@pytest.fixture(params=["gemv", "torch-int4"])
def int4_llama(request, tiny_llama_dir, monkeypatch):
    """The tiny Llama in bf16 with its layers on 4-bit weights, as the model runner packs
    a GGUF Q4 model (the packing quantizes any bf16 weights): in the skinny GEMV's layout
    (the default) and in torch's int4pack (PAGODA_CPU_GEMV=0)."""
    from pagoda.model.loader import load_arch_config, load_model

    monkeypatch.setenv("PAGODA_CPU_GEMV", "1" if request.param == "gemv" else "0")
    model = load_model(tiny_llama_dir, load_arch_config(tiny_llama_dir), torch.bfloat16)
    gguf_int4.pack_small_batch_int4(model, None, gguf_int4.MAX_INT4_ROWS_PACKED)
    return model


def run_steps(model, steps, paged_sequences, fused: bool, calls: list | None = None):
    """Hidden states and logits of each step; `fused` False forces the Python loop."""
    model.model._fused_decode = False if fused else None  # decided again / never
    seqs = paged_sequences(num_blocks=32, block_size=4)
    g = torch.Generator().manual_seed(0)
    for name in "abcde":
        seqs.add(name, torch.randint(0, 49152, (40,), generator=g).tolist())
    caches = allocate_kv_caches(model.arch, 32, 4, torch.bfloat16, "cpu")
    out = []
    with torch.inference_mode():
        for schedule in steps:
            input_ids, positions, md = seqs.step(schedule)
            stack = model.model.fused_decode_stack()
            if calls is not None:
                cos = model.model.rotary_emb(positions, torch.bfloat16)[0]
                calls.append(stack is not None and stack.applies(
                    model.model.embed(input_ids), cos, md, caches))
            hidden = model(input_ids, positions, caches, md)
            out.append((hidden, model.compute_logits(hidden)))
    return out


STEPS = [
    [("a", 9), ("b", 5), ("c", 3), ("d", 6), ("e", 2)],  # prefills: the loop
    [("a", 1), ("b", 1), ("c", 1), ("d", 1)],  # 4 decodes: fused
    [("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1)],  # 5 rows > int4's 4: the loop
    [("b", 1)],  # one decode: fused
    [("a", 1), ("b", 1), ("c", 3)],  # decodes and a chunk: the loop
    [("c", 1), ("a", 1)],
    [("a", 1)],
]


def test_fused_decode_steps_equal_the_python_loop_bit_for_bit(int4_llama, paged_sequences):
    calls: list[bool] = []
    fused = run_steps(int4_llama, STEPS, paged_sequences, fused=True, calls=calls)
    assert calls == [False, True, False, True, False, True, True]
    loop = run_steps(int4_llama, STEPS, paged_sequences, fused=False)
    for (h_fused, l_fused), (h_loop, l_loop) in zip(fused, loop, strict=True):
        assert torch.equal(h_fused, h_loop)
        assert torch.equal(l_fused, l_loop)


def test_where_it_applies(int4_llama, tiny_llama_dir, monkeypatch):
    from pagoda.model.loader import load_arch_config, load_model

    assert int4_llama.model.fused_decode_stack() is not None
    arch = load_arch_config(tiny_llama_dir)
    bf16 = load_model(tiny_llama_dir, arch, torch.bfloat16)  # no int4 weights
    assert bf16.model.fused_decode_stack() is None
    fp32 = load_model(tiny_llama_dir, arch, torch.float32)
    assert fp32.model.fused_decode_stack() is None
    monkeypatch.setenv("PAGODA_CPU_FUSED_DECODE", "0")
    int4_llama.model._fused_decode = False
    assert int4_llama.model.fused_decode_stack() is None
    monkeypatch.delenv("PAGODA_CPU_FUSED_DECODE")
    int4_llama.model._fused_decode = False
    # A sliding window (or any other variant of the layer) keeps the Python loop.
    int4_llama.model.layers[1].self_attn.sliding_window = 8
    assert int4_llama.model.fused_decode_stack() is None


def test_the_default_engine_decodes_through_it_with_the_loop_s_tokens(monkeypatch):
    from pagoda import LLM, SamplingParams

    llm = LLM(max_model_len=256, dtype="bfloat16")  # the default GGUF Q4_1 model
    stack_owner = llm.llm_engine.core.executor.runner.model.model
    calls = []
    real = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers",
                        lambda *a: calls.append(a[0].shape[0]) or real(*a))
    prompts = ["Count: 1, 2, 3,", "What is the capital of France?"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)

    def answers():
        llm.llm_engine.core.reset_prefix_cache()  # both runs prefill the whole prompts
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    fused = answers()
    assert calls and set(calls) == {2}  # both requests' decode steps, in one call each
    stack_owner._fused_decode = None  # the Python loop from here on
    calls.clear()
    assert answers() == fused and not calls

