"""Quantized linear layers under tensor parallelism: each rank cuts its slice out of the
packed checkpoint tensors (int4 words of 8 rows or columns, per-group scales, act-order's
g_idx, FP8 block scales), and the ranks together compute the dequantized layer."""

from __future__ import annotations

import pytest
import torch
from group_cases import engine_kwargs
from quant_cases import FORMATS, quantize_tensor, save_quantized

from pagoda import LLM, SamplingParams
from pagoda.model.parallel_layers import MergedColumnParallelLinear, QKVParallelLinear, \
    RowParallelLinear
from pagoda.model.quantization import (get_quantization_config, process_weights_after_loading,
                                       quantized_construction)

H, D, HEADS, KV_HEADS, INTER = 64, 16, 4, 2, 64


def _checkpoint(fmt: str, name: str, w: torch.Tensor, seed: int):
    """{attr: tensor} of one quantized HF linear, as the loader would pass them on."""
    config = get_quantization_config(FORMATS[fmt])
    tensors, deq = quantize_tensor(fmt, f"{name}.weight", w, seed)
    parts = {}
    for full_name, t in tensors.items():
        t = config.checkpoint_tensor(full_name, t)
        if t is not None:
            parts[full_name.rpartition(".")[2]] = t
    return parts, deq


def _load(layer, shards: dict[str | None, dict[str, torch.Tensor]]):
    for shard, tensors in shards.items():
        for attr, full in tensors.items():
            assert layer.checkpoint_shape(attr, shard) == tuple(full.shape), (attr, shard)
            layer.load_weight(attr, shard, full)
    process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq-act-order", "fp8-tensor", "fp8-block",
                                 "ct-channel"])
def test_quantized_attention_and_mlp_projections_split_over_two_ranks(ranks, fmt):
    torch.manual_seed(0)
    full = {"q_proj": torch.randn(HEADS * D, H), "k_proj": torch.randn(KV_HEADS * D, H),
            "v_proj": torch.randn(KV_HEADS * D, H), "o_proj": torch.randn(H, HEADS * D),
            "gate_proj": torch.randn(INTER, H), "up_proj": torch.randn(INTER, H),
            "down_proj": torch.randn(H, INTER)}
    # Same seed for projections of one input: act-order's g_idx is shared (see quant_cases).
    seeds = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2,
             "up_proj": 2, "down_proj": 3}
    ckpt, deq = {}, {}
    for name, w in full.items():
        ckpt[name], deq[name] = _checkpoint(fmt, name, w, seeds[name])
    x = torch.randn(5, H)
    config = get_quantization_config(FORMATS[fmt])

    def body(h, rank):
        p = h.parallel
        with quantized_construction(config):
            qkv = QKVParallelLinear(H, D, HEADS, KV_HEADS, False, torch.float32, p)
            o_proj = RowParallelLinear(HEADS * D, H, False, torch.float32, p)
            gate_up = MergedColumnParallelLinear(H, {"gate_proj": INTER, "up_proj": INTER},
                                                 False, torch.float32, p)
            down = RowParallelLinear(INTER, H, False, torch.float32, p)
        _load(qkv, {s: ckpt[s] for s in ("q_proj", "k_proj", "v_proj")})
        _load(o_proj, {None: ckpt["o_proj"]})
        _load(gate_up, {s: ckpt[s] for s in ("gate_proj", "up_proj")})
        _load(down, {None: ckpt["down_proj"]})
        q_local = qkv(x)[:, :HEADS * D // 2]
        # The row-parallel layers take this rank's half of the input columns.
        half = slice(rank * HEADS * D // 2, (rank + 1) * HEADS * D // 2)
        mlp_half = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
        return q_local, o_proj(x[:, half]), gate_up(x), down(x[:, mlp_half])

    results = ranks(2, body)
    for rank, (q_local, o_out, gate_up_out, down_out) in enumerate(results):
        rows = slice(rank * HEADS * D // 2, (rank + 1) * HEADS * D // 2)
        torch.testing.assert_close(q_local, x @ deq["q_proj"][rows].T, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(o_out, x @ deq["o_proj"].T, atol=1e-4, rtol=1e-5)
        inter = slice(rank * INTER // 2, (rank + 1) * INTER // 2)
        torch.testing.assert_close(gate_up_out, torch.cat(
            [x @ deq["gate_proj"][inter].T, x @ deq["up_proj"][inter].T], dim=-1),
            atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(down_out, x @ deq["down_proj"].T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["gptq-act-order", "fp8-block"])
def test_greedy_tokens_at_tp2_equal_the_dequantized_model(tmp_path, tiny_llama_dir, fmt):
    save_quantized(tiny_llama_dir, fmt, str(tmp_path / "q"), str(tmp_path / "ref"))
    prompts = [{"prompt_token_ids": [5, 17, 300, 42, 7, 8]},
               {"prompt_token_ids": list(range(100, 130))}]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = []
    for path, tp in ((tmp_path / "q", 2), (tmp_path / "ref", 1)):
        llm = LLM(model=str(path), tensor_parallel_size=tp,
                  distributed_executor_backend="mp" if tp > 1 else None, **engine_kwargs())
        try:
            tokens.append([o.outputs[0].token_ids
                           for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.llm_engine.core.shutdown()
    assert tokens[0] == tokens[1]
