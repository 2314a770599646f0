"""Bare `*Model` checkpoints (no LM head, no `model.` prefix) served as embedding models
against transformers' own classes on tiny random fp32 checkpoints: decoders (e5-mistral's
`MistralModel`, gte-Qwen2's `Qwen2Model`, `LlamaModel`, `Qwen3Model`) pool the last
token unless sentence-transformers says otherwise; `XLMRobertaModel` numbers positions
from padding_idx + 1 and pools as its sentence-transformers folder says (else CLS).
`--runner auto` resolves to pooling for all of them."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F
from arch_parity import VOCAB_SIZE, random_prompts
from pooling_cases import VOCAB, add_sentence_transformers, cosine_distance, save_tokenizer
from transformers import (LlamaConfig, LlamaModel, MistralConfig, MistralModel, Qwen2Config,
                          Qwen2Model, Qwen3Config, Qwen3Model, XLMRobertaConfig,
                          XLMRobertaModel)

from pagoda import LLM

MAX_COSINE_DISTANCE = 1e-4
DECODER_SHAPE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256, initializer_range=0.2)
DECODERS = {"MistralModel": (MistralConfig, MistralModel),
            "Qwen2Model": (Qwen2Config, Qwen2Model),
            "LlamaModel": (LlamaConfig, LlamaModel),
            "Qwen3Model": (Qwen3Config, Qwen3Model)}
XLMR_POSITIONS = 64  # max_position_embeddings 66 less padding_idx (1) + 1


def save_bare(path, model, tokenizer) -> str:
    """Random norm weights too, so every layer visibly changes the hidden states."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name.lower() and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer(path)
    return str(path)


def hf_hidden(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).last_hidden_state[0] for ids in prompts]


def pagoda_embeddings(path: str, prompts: list[list[int]]) -> tuple[LLM, list]:
    llm = LLM(path, dtype="float32")  # runner auto
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], use_tqdm=False)
    return llm, [o.outputs.embedding for o in outputs]


def assert_close(ours: list, expected: list[torch.Tensor]) -> None:
    assert len(ours) == len(expected)
    for got, want in zip(ours, expected):
        assert cosine_distance(got, want) < MAX_COSINE_DISTANCE


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_bare_decoder_embeds_its_last_token(tmp_path, smollm2_tokenizer, name):
    config_cls, model_cls = DECODERS[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**DECODER_SHAPE))
    path = save_bare(tmp_path, model, smollm2_tokenizer.save_pretrained)
    prompts = random_prompts([3, 11, 17])
    llm, ours = pagoda_embeddings(path, prompts)
    assert llm.llm_engine.config.runner == "pooling"
    assert llm.llm_engine.config.arch.architecture == name
    assert_close(ours, [F.normalize(h[-1], dim=0) for h in hf_hidden(model, prompts)])


def test_bare_decoder_pools_as_its_sentence_transformers_folder_says(tmp_path,
                                                                     smollm2_tokenizer):
    torch.manual_seed(1)
    model = Qwen2Model(Qwen2Config(**DECODER_SHAPE))
    path = save_bare(tmp_path, model, smollm2_tokenizer.save_pretrained)
    add_sentence_transformers(tmp_path, "mean", normalize=False)
    prompts = random_prompts([4, 9])
    _, ours = pagoda_embeddings(path, prompts)
    expected = [h.mean(dim=0) for h in hf_hidden(model, prompts)]
    assert_close(ours, expected)
    for got, want in zip(ours, expected):  # not normalised: no Normalize module
        assert torch.linalg.norm(torch.tensor(got)) == pytest.approx(float(want.norm()),
                                                                     rel=1e-4)


def xlm_roberta(path, pooling: str | None) -> tuple[str, XLMRobertaModel]:
    """transformers' defaults for what the released checkpoints share: pad_token_id 1,
    position rows offset by 2; one token type, as in xlm-roberta-base."""
    torch.manual_seed(2)
    config = XLMRobertaConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=XLMR_POSITIONS + 2, type_vocab_size=1,
                              layer_norm_eps=1e-5, initializer_range=0.2)
    assert config.pad_token_id == 1
    model = XLMRobertaModel(config)
    path = save_bare(path, model, save_tokenizer)
    if pooling is not None:
        add_sentence_transformers(pathlib.Path(path), pooling, normalize=True)
    return path, model


@pytest.mark.parametrize("pooling", ["mean", "cls", None])
def test_xlm_roberta_positions_start_after_the_padding_index(tmp_path, pooling):
    path, model = xlm_roberta(tmp_path, pooling)
    # Token ids above the specials (never the padding id); one prompt fills every position.
    prompts = random_prompts([5, 13, XLMR_POSITIONS], vocab_size=len(VOCAB), seed=4)[:3]
    llm, ours = pagoda_embeddings(path, prompts)
    assert llm.llm_engine.config.runner == "pooling"
    assert llm.llm_engine.config.scheduler.max_model_len == XLMR_POSITIONS
    hidden = hf_hidden(model, prompts)
    pooled = [h.mean(dim=0) if pooling == "mean" else h[0] for h in hidden]
    assert_close(ours, [F.normalize(p, dim=0) for p in pooled])
