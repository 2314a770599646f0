"""Rank layout, layer split and the start-up checks of a parallel configuration."""

from __future__ import annotations

import pytest

from pagoda.config import ModelArchConfig
from pagoda.distributed.parallel_state import (ParallelContext, kv_head_start, rank_coordinates,
                                               stage_layer_range, validate_parallel_config)


def arch(**overrides) -> ModelArchConfig:
    values = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    values.update(overrides)
    return ModelArchConfig(**values)


@pytest.mark.parametrize("num_layers,pp_size", [(3, 1), (3, 2), (3, 3), (30, 4), (7, 3)])
def test_stages_cover_every_layer_once_in_order(num_layers, pp_size):
    ranges = [stage_layer_range(num_layers, pp_size, s) for s in range(pp_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_tensor_parallel_ranks_are_contiguous_within_a_stage():
    assert [rank_coordinates(r, 2) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ctx = ParallelContext(tp_size=2, tp_rank=1, pp_size=2, pp_rank=0)
    assert (ctx.rank, ctx.next_rank, ctx.output_rank) == (1, 3, 2)
    assert ctx.is_first_stage and not ctx.is_last_stage


@pytest.mark.parametrize("num_kv,tp,starts", [
    (2, 2, [0, 1]),        # one KV head each
    (4, 2, [0, 2]),        # two each
    (2, 4, [0, 0, 1, 1]),  # fewer KV heads than ranks: each replicated on two ranks
    (1, 4, [0, 0, 0, 0]),  # multi-query attention
])
def test_kv_heads_split_or_replicated(num_kv, tp, starts):
    assert [kv_head_start(num_kv, tp, r) for r in range(tp)] == starts


def test_heads_not_divisible_by_tp_is_refused_with_vllms_message():
    with pytest.raises(ValueError, match=r"^Total number of attention heads \(9\) must be "
                                         r"divisible by tensor parallel size \(2\)\.$"):
        validate_parallel_config(arch(num_attention_heads=9, num_key_value_heads=3), 2, 1)


@pytest.mark.parametrize("overrides,tp,pp,match", [
    ({"num_key_value_heads": 6, "num_attention_heads": 12}, 4, 1, r"key-value heads \(6\)"),
    ({"num_key_value_heads": 3, "num_attention_heads": 12}, 4, 1, r"Tensor parallel size \(4\)"),
    ({"intermediate_size": 130}, 4, 1, r"Intermediate size \(130\)"),
    ({}, 1, 4, r"Pipeline parallel size \(4\) must not exceed the number of hidden layers \(3\)"),
    ({}, 0, 1, "must be positive"),
])
def test_other_impossible_splits_are_refused(overrides, tp, pp, match):
    with pytest.raises(ValueError, match=match):
        validate_parallel_config(arch(**overrides), tp, pp)


def test_engine_args_check_the_model_before_starting_anything(tiny_llama_dir):
    from pagoda.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match=r"attention heads \(4\) must be divisible by tensor "
                                         r"parallel size \(3\)"):
        EngineArgs(model=tiny_llama_dir, tensor_parallel_size=3).create_engine_config()
    config = EngineArgs(model=tiny_llama_dir, tensor_parallel_size=2,
                        distributed_executor_backend="mp").create_engine_config()
    assert (config.world_size, config.distributed_executor_backend) == (2, "mp")
    single = EngineArgs(model=tiny_llama_dir).create_engine_config()
    assert single.distributed_executor_backend is None


def test_default_backend_is_ray_when_installed(tiny_llama_dir):
    from pagoda.engine.arg_utils import EngineArgs

    config = EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=2).create_engine_config()
    assert config.distributed_executor_backend == "ray"


@pytest.mark.slow
def test_smollm2_with_two_ranks_is_refused_before_loading(smollm2_gguf_path):
    from pagoda import LLM

    with pytest.raises(ValueError, match=r"^Total number of attention heads \(9\) must be "
                                         r"divisible by tensor parallel size \(2\)\.$"):
        LLM(model=smollm2_gguf_path, tensor_parallel_size=2)
