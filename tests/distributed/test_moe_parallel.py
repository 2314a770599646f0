"""Mixture of experts over tensor-parallel ranks: each expert split like a dense MLP
(default), or experts placed whole per rank (`enable_expert_parallel`). Layer-level on
threads of this process, then end to end through `pagoda.LLM` on real process groups
(the `mp` backend), against transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch
from moe_cases import hf_greedy, save_tiny_mixtral, save_tiny_qwen2_moe, save_tiny_qwen3_moe
from quant_cases import save_quantized

from pagoda import LLM, SamplingParams
from pagoda.distributed.parallel_state import ParallelContext, expert_range
from pagoda.model.moe import FusedMoE

pytestmark = pytest.mark.extended  # make test-extended

E, K, H, I = 5, 2, 16, 8  # experts, top-k, hidden, intermediate


def _full_layer():
    torch.manual_seed(0)
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    return gate, up, down


def _load(layer: FusedMoE, gate, up, down) -> FusedMoE:
    for name, shape in layer.checkpoint_tensors().items():
        if shape is None:
            continue
        e, proj, _ = name.split(".")
        full = {"gate_proj": gate, "up_proj": up, "down_proj": down}[proj][int(e)]
        assert tuple(full.shape) == shape
        layer.load_checkpoint_tensor(name, full)
    return layer


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_holds_its_share_and_the_sum_is_the_whole_layer(ranks, expert_parallel):
    gate, up, down = _full_layer()
    x, logits = torch.randn(7, H), torch.randn(7, E)
    whole = _load(FusedMoE(E, K, H, I, True, torch.float32), gate, up, down)(x, logits)

    def body(h, rank):
        parallel = ParallelContext(h.parallel.tp_size, rank, tp_group=h.parallel.tp_group,
                                   enable_expert_parallel=expert_parallel)
        layer = _load(FusedMoE(E, K, H, I, True, torch.float32, parallel), gate, up, down)
        held = (layer.w13_weight.shape, layer.expert_start, layer.expert_end)
        return layer(x, logits), held

    results = ranks(2, body)
    for out, _ in results:
        torch.testing.assert_close(out, whole, atol=1e-4, rtol=1e-5)
    if expert_parallel:  # 5 experts: 3 whole on rank 0, 2 on rank 1
        assert [held for _, held in results] == [((3, 2 * I, H), 0, 3), ((2, 2 * I, H), 3, 5)]
    else:  # every expert, half of its intermediate rows
        assert [held for _, held in results] == [((E, I, H), 0, E)] * 2


def test_expert_range_splits_as_evenly_as_possible():
    ranges = [expert_range(10, ParallelContext(4, r, enable_expert_parallel=True))
              for r in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert expert_range(10, ParallelContext(4, 2)) == (0, 10)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("moe_tp")
    return {"mixtral": save_tiny_mixtral(root / "mixtral", smollm2_tokenizer),
            "qwen3_moe": save_tiny_qwen3_moe(root / "qwen3_moe", smollm2_tokenizer),
            "qwen2_moe": save_tiny_qwen2_moe(root / "qwen2_moe", smollm2_tokenizer)}


PROMPTS = [[5, 17, 300, 42, 7, 8, 9, 10, 11, 12], list(range(300, 318)), [9] * 5]


@pytest.mark.parametrize("model,tp,expert_parallel", [
    ("mixtral", 1, False), ("mixtral", 2, False), ("mixtral", 2, True), ("qwen3_moe", 2, True),
    ("qwen2_moe", 2, False), ("qwen2_moe", 2, True)])
def test_greedy_tokens_equal_transformers(moe_dirs, model, tp, expert_parallel):
    path = moe_dirs[model]
    tokens, report = _greedy(path, tp, expert_parallel)
    assert tokens == [hf_greedy(path, p, 8) for p in PROMPTS]
    if tp > 1:  # each rank holds half the experts' weights, whichever way they are split
        assert len({r["parameter_bytes"] for r in report}) == 1


def _greedy(path: str, tp: int, expert_parallel: bool):
    """(greedy tokens of PROMPTS, the ranks' memory report or None at TP=1)."""
    llm = LLM(model=path, dtype="float32", block_size=4, max_model_len=128,
              num_gpu_blocks_override=64, max_num_batched_tokens=16,
              tensor_parallel_size=tp, distributed_executor_backend="mp" if tp > 1 else None,
              enable_expert_parallel=expert_parallel)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                               use_tqdm=False)
        report = llm.llm_engine.core.executor.memory_report() if tp > 1 else None
    finally:
        llm.llm_engine.core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs], report


@pytest.mark.parametrize("model,fmt,expert_parallel", [("qwen3_moe", "fp8-block", True),
                                                       ("qwen2_moe", "gptq", False)])
def test_quantized_experts_at_tp2_equal_transformers_on_the_dequantized_model(
        smollm2_tokenizer, tmp_path, model, fmt, expert_parallel):
    """Each rank dequantizes the experts it holds (EP) or its slice of each (TP); the shared
    expert stays quantized, split like a dense MLP. The dense layer is 128 wide: a rank's
    half then holds whole quantization groups and FP8 blocks (of 32 columns)."""
    save = save_tiny_qwen3_moe if model == "qwen3_moe" else save_tiny_qwen2_moe
    src = save(tmp_path / "src", smollm2_tokenizer, intermediate_size=128)
    save_quantized(src, fmt, str(tmp_path / "q"), str(tmp_path / "ref"))
    tokens, _ = _greedy(str(tmp_path / "q"), 2, expert_parallel)
    assert tokens == [hf_greedy(str(tmp_path / "ref"), p, 8) for p in PROMPTS]


def test_expert_parallel_needs_an_expert_per_rank():
    from pagoda.config import ModelArchConfig, MoEConfig
    from pagoda.distributed.parallel_state import validate_parallel_config

    arch = ModelArchConfig(vocab_size=10, hidden_size=64, intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                           head_dim=8, moe=MoEConfig(num_experts=2, num_experts_per_tok=1,
                                                     intermediate_size=32))
    validate_parallel_config(arch, 4, 1)  # each expert split 4 ways: fine
    with pytest.raises(ValueError, match=r"Number of experts \(2\) must be at least the "
                                         r"tensor parallel size \(4\)"):
        validate_parallel_config(arch, 4, 1, enable_expert_parallel=True)
