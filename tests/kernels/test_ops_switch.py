"""`pagoda.model.ops`: torch path on CPU, Triton path on CUDA, same results.

Without a GPU the Triton side runs on CPU tensors by forcing the switch (the
interpreter executes the kernels); with one it runs compiled on CUDA. A tiny random
Llama (whose layers call `ops`) gives the same logits through either path.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagoda.config import ModelArchConfig, SlidingWindowConfig
from pagoda.kernels.testing import random_paged_batch, relative_error
from pagoda.model import attention, layers, ops, rotary
from pagoda.model.architectures import gemma2, gemma3, llama
from pagoda.model.attention_metadata import AttentionMetadata


@pytest.fixture
def triton_device(device, monkeypatch) -> str:
    """The device whose tensors `ops` sends to Triton (CPU: forced, interpreted)."""
    if device == "cpu":
        monkeypatch.setattr(ops, "use_triton", lambda t: True)
    return device


def test_cpu_process_never_imports_triton():
    code = (
        "import sys, torch\n"
        "triton_before = 'triton' in sys.modules\n"  # a CUDA build of torch may import it itself
        "from pagoda.model import ops\n"
        "x = torch.randn(3, 8)\n"
        "ops.rms_norm(x, torch.ones(8), 1e-5, x)\n"
        "ops.silu_and_mul(x)\n"
        "assert not ops.use_triton(x)\n"
        "assert ('triton' in sys.modules) == triton_before, 'triton imported on the CPU path'\n"
        "x = x.bfloat16()\n"  # the bf16 CPU path: Pagoda's C++ kernels, still no triton
        "ops.rms_norm(x, torch.ones(8, dtype=x.dtype), 1e-5, x)\n"
        "ops.silu_and_mul(x)\n"
        "assert ('triton' in sys.modules) == triton_before, 'triton imported on the CPU path'\n"
        "triton_modules = [m for m in sys.modules if m.startswith('pagoda.kernels')\n"
        "                  and not m.startswith('pagoda.kernels.cpu')\n"
        "                  and m not in ('pagoda.kernels', 'pagoda.kernels.attention_metadata',\n"
        "                            'pagoda.kernels.cache_dir')]\n"
        "assert not triton_modules, triton_modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_elementwise_ops_agree_between_paths(triton_device):
    torch.manual_seed(0)
    x, r, w = (torch.randn(*s, device=triton_device) for s in [(5, 48), (5, 48), (48,)])
    norm = layers.RMSNorm(48, 1e-6, torch.float32).to(triton_device)
    norm.weight.copy_(w)
    for got, want in zip(ops.rms_norm(x, w, 1e-6, r), norm(x, r)):
        torch.testing.assert_close(got, want)
    got, passthrough = ops.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(got, norm(x)[0])
    assert passthrough is x
    gate_up = torch.randn(5, 2, 64, device=triton_device)  # leading dims flattened and restored
    torch.testing.assert_close(ops.silu_and_mul(gate_up), layers.silu_and_mul(gate_up))
    qk = torch.randn(5, 6, 16, device=triton_device)
    rope = rotary.RotaryEmbedding(16, 10000.0, None, 64).to(triton_device)
    cos, sin = rope(torch.tensor([0, 3, 9, 1, 50], device=triton_device), torch.float32)
    torch.testing.assert_close(ops.rotary_embedding(qk, cos, sin), rotary.apply_rotary(qk, cos, sin))


def test_attention_ops_agree_between_paths(triton_device):
    batch = random_paged_batch([(6, 1), (0, 5), (9, 4)], 6, 2, 16, 4, device=triton_device, seed=3)
    md = batch.attn_metadata
    caches = [(batch.key_cache.clone(), batch.value_cache.clone()) for _ in range(2)]
    ops.write_kv_cache(batch.key, batch.value, *caches[0], md.slot_mapping)
    attention.write_kv_cache(batch.key, batch.value, *caches[1], md.slot_mapping)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    got = ops.paged_attention(batch.query, *caches[0], md, 0.3)
    want = attention.paged_attention(batch.query, *caches[1], md, 0.3)
    assert relative_error(got, want) < 1e-5


# Gemma 2: a 3-token window on alternate layers, soft-capped scores and logits, Gemma
# norms, GeGLU; Gemma 3: windows, per-head q/k norms, a local RoPE base.
GEMMA2 = dict(hidden_act="gelu_pytorch_tanh",
              sliding_window=SlidingWindowConfig(3, ("sliding_attention", "full_attention")),
              family_settings=gemma2.GemmaSettings(query_pre_attn_scalar=12.0,
                                                   attn_logit_softcapping=1.5,
                                                   final_logit_softcapping=4.0))
GEMMA3 = dict(GEMMA2, family_settings=gemma3.Gemma3Settings(
    query_pre_attn_scalar=12.0, final_logit_softcapping=4.0, local_rope_theta=100.0))
MODELS = {"llama": (llama.LlamaForCausalLM, {}), "gemma2": (gemma2.Gemma2ForCausalLM, GEMMA2),
          "gemma3": (gemma3.Gemma3ForCausalLM, GEMMA3)}


def _tiny_llama(device: str, name: str = "llama") -> llama.LlamaForCausalLM:
    model_cls, variant = MODELS[name]
    arch = ModelArchConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                           tie_word_embeddings=True, **variant)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(arch, torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.3 * torch.randn_like(p))
    return model.eval()


def _prefill_then_decode(model, device: str, block_size: int = 4) -> list[torch.Tensor]:
    """Prompts of 5 and 7 tokens prefilled, then one decode step: logits of both steps."""
    arch = model.arch
    shape = (16, block_size, arch.num_key_value_heads, arch.head_dim)
    caches = [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
              for _ in range(arch.num_hidden_layers)]
    tables = [[3, 7], [1, 12]]
    prompts = [[5, 17, 2, 90, 41], [8, 8, 33, 60, 1, 2, 3]]
    logits = []
    for step in ("prefill", "decode"):
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for prompt, table in zip(prompts, tables):
            start = 0 if step == "prefill" else len(prompt) - 1
            for p in range(start, len(prompt)):
                ids.append(prompt[p])
                pos.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
            qsl.append(len(ids))
            seq_lens.append(len(prompt))

        def t(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        md = AttentionMetadata(t(slots), t(qsl, torch.int32), t(seq_lens, torch.int32),
                               t(tables, torch.int32), num_decodes=2 if step == "decode" else 0,
                               max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
                               max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
                               seq_lens_cpu=seq_lens)
        hidden = model(t(ids), t(pos), caches, md)
        logits.append(model.compute_logits(hidden[[q - 1 for q in qsl[1:]]]))
        prompts = [p + [tok] for p, tok in zip(prompts, logits[-1].argmax(-1).tolist())]
    return logits


@pytest.mark.parametrize("name", list(MODELS))
def test_tiny_model_through_triton_kernels_matches_torch_path(device, monkeypatch, name):
    model = _tiny_llama(device, name)
    with torch.no_grad():
        monkeypatch.setattr(ops, "use_triton", lambda t: False)
        expected = _prefill_then_decode(model, device)
        monkeypatch.setattr(ops, "use_triton", lambda t: True)
        got = _prefill_then_decode(model, device)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert torch.equal(g.argmax(-1), e.argmax(-1))
