"""Each tensor-parallel layer, split over T ranks, computes what the whole layer does,
while every rank holds only its slice."""

from __future__ import annotations

import pytest
import torch
from model_steps import two_steps

from pagoda.config import ModelArchConfig
from pagoda.model.parallel_layers import (ColumnParallelLinear, MergedColumnParallelLinear,
                                          ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                                          VocabParallelEmbedding)

H, D = 32, 8  # hidden size, head dim


def _load(layer, weights: dict[tuple[str, str | None], torch.Tensor]):
    for (attr, shard), full in weights.items():
        assert layer.checkpoint_shape(attr, shard) == tuple(full.shape)
        layer.load_weight(attr, shard, full)
    return layer


@pytest.mark.parametrize("tp,num_heads,num_kv_heads", [(2, 4, 2), (4, 4, 2), (2, 4, 4), (4, 8, 1)])
def test_qkv_then_row_parallel_output_equals_the_whole_attention_projection(
        ranks, tp, num_heads, num_kv_heads):
    torch.manual_seed(0)
    weights = {("weight", "q_proj"): torch.randn(num_heads * D, H),
               ("weight", "k_proj"): torch.randn(num_kv_heads * D, H),
               ("weight", "v_proj"): torch.randn(num_kv_heads * D, H),
               ("bias", "q_proj"): torch.randn(num_heads * D),
               ("bias", "k_proj"): torch.randn(num_kv_heads * D),
               ("bias", "v_proj"): torch.randn(num_kv_heads * D)}
    o_weight, o_bias = torch.randn(H, num_heads * D), torch.randn(H)
    x = torch.randn(5, H)
    q, k, v = (x @ weights[("weight", n)].T + weights[("bias", n)] for n in ("q_proj", "k_proj",
                                                                             "v_proj"))
    group = num_heads // num_kv_heads

    def body(h, rank):
        qkv = _load(QKVParallelLinear(H, D, num_heads, num_kv_heads, True, torch.float32,
                                      h.parallel), weights)
        out = qkv(x)
        local_q, local_kv = qkv.num_local_heads, qkv.num_local_kv_heads
        lq, lk, lv = out.split([local_q * D, local_kv * D, local_kv * D], dim=-1)
        # Each local query head must meet the KV head the whole model pairs it with.
        for i in range(local_q):
            head = rank * local_q + i
            kv_head = head // group
            local_kv_index = kv_head - qkv.parts["k_proj"][1] // D
            q_rows = slice(head * D, (head + 1) * D)
            assert torch.allclose(lq[:, i * D:(i + 1) * D], q[:, q_rows], atol=1e-5)
            kv_rows = slice(local_kv_index * D, (local_kv_index + 1) * D)
            assert torch.allclose(lk[:, kv_rows], k[:, kv_head * D:(kv_head + 1) * D], atol=1e-5)
            assert torch.allclose(lv[:, kv_rows], v[:, kv_head * D:(kv_head + 1) * D], atol=1e-5)
        o_proj = _load(RowParallelLinear(num_heads * D, H, True, torch.float32, h.parallel),
                       {("weight", None): o_weight, ("bias", None): o_bias})
        assert o_proj.weight.shape == (H, num_heads * D // tp)
        return o_proj(q[:, rank * local_q * D:(rank + 1) * local_q * D])

    for out in ranks(tp, body):
        torch.testing.assert_close(out, q @ o_weight.T + o_bias, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_merged_gate_up_holds_each_projections_slice(ranks, tp):
    torch.manual_seed(1)
    gate, up, x = torch.randn(16, H), torch.randn(16, H), torch.randn(3, H)

    def body(h, rank):
        layer = _load(MergedColumnParallelLinear(H, {"gate_proj": 16, "up_proj": 16}, False,
                                                 torch.float32, h.parallel),
                      {("weight", "gate_proj"): gate, ("weight", "up_proj"): up})
        return layer(x)

    rows = 16 // tp
    for rank, out in enumerate(ranks(tp, body)):
        sl = slice(rank * rows, (rank + 1) * rows)
        torch.testing.assert_close(out, torch.cat([x @ gate[sl].T, x @ up[sl].T], dim=-1))


def test_column_parallel_split(ranks):
    weight, x = torch.randn(12, H), torch.randn(2, H)

    def body(h, rank):
        return _load(ColumnParallelLinear.split(H, 12, False, torch.float32, h.parallel),
                     {("weight", None): weight})(x)

    assert torch.allclose(torch.cat(ranks(3, body), dim=-1), x @ weight.T, atol=1e-5)


@pytest.mark.parametrize("tp,vocab", [(2, 96), (2, 97), (4, 97)])
def test_vocab_parallel_embedding_and_lm_head_cover_an_uneven_vocabulary(ranks, tp, vocab):
    torch.manual_seed(2)
    table = torch.randn(vocab, H)
    ids = torch.tensor([0, vocab - 1, vocab // 2, 3, vocab - 1])
    hidden = torch.randn(4, H)

    def body(h, rank):
        embed = _load(VocabParallelEmbedding(vocab, H, torch.float32, h.parallel),
                      {("weight", None): table})
        head = _load(ParallelLMHead(vocab, H, torch.float32, h.parallel), {("weight", None): table})
        assert embed.weight.shape == (-(-vocab // tp), H)
        return embed(ids), head.compute_logits(hidden)

    results = ranks(tp, body)
    for rank, (embedded, logits) in enumerate(results):
        assert torch.equal(embedded, table[ids])  # a sum with zeros: exact
        if rank == 0:
            torch.testing.assert_close(logits, hidden @ table.T)
        else:
            assert logits is None


def test_sharded_model_logits_equal_the_whole_model(ranks, tiny_llama_dir):
    """TP=2 and TP=4 (KV heads replicated) LlamaForCausalLM on a prefill then a decode."""
    from pagoda.model.kv_cache import allocate_kv_caches
    from pagoda.model.loader import load_arch_config, load_model

    arch: ModelArchConfig = load_arch_config(tiny_llama_dir)
    steps = two_steps()

    def run(parallel):
        model = load_model(tiny_llama_dir, arch, torch.float32, "cpu", parallel)
        caches = allocate_kv_caches(arch, 8, 4, torch.float32, "cpu", parallel)
        with torch.inference_mode():
            return [model.compute_logits(model(ids, pos, caches, md)) for ids, pos, md in steps]

    whole = run(None)
    for tp in (2, 4):
        sharded = ranks(tp, lambda h, rank: run(h.parallel))[0]
        for got, want in zip(sharded, whole):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
