"""Fixtures for structured outputs: the grammar backend on SmolLM2's vocabulary, and a
tiny random model whose tokenizer has `<think>`/`</think>` tokens (a reasoning model's
vocabulary) and whose embedding is larger than the tokenizer (as real models pad it)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from pagoda.config import StructuredOutputsConfig
from pagoda.structured_output import StructuredOutputManager

TINY_LLAMA_CONFIG = pathlib.Path(__file__).parent.parent / "fixtures" / "tiny_llama" / "config.json"
THINK_VOCAB_SIZE = 49160  # the tokenizer has 49154 tokens: 6 padding rows past it
EOS = 2


@pytest.fixture(scope="session")
def make_manager(smollm2_tokenizer):
    """StructuredOutputManager(config=..., tokenizer=SmolLM2's by default)."""
    managers = []

    def make(config: StructuredOutputsConfig | None = None, tokenizer=None,
             vocab_size: int = 49152) -> StructuredOutputManager:
        tok = tokenizer or smollm2_tokenizer
        manager = StructuredOutputManager(config or StructuredOutputsConfig(), vocab_size,
                                          lambda: tok, [EOS])
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.shutdown()


@pytest.fixture(scope="session")
def think_model_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    """The tiny Llama with SmolLM2's tokenizer plus `<think>` and `</think>` (added, not
    special: they show in the text, as in Qwen3's and DeepSeek-R1's tokenizers)."""
    from transformers import AddedToken, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_json_file(str(TINY_LLAMA_CONFIG))
    config.vocab_size = THINK_VOCAB_SIZE
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("think_llama")
    model.save_pretrained(out)
    tokenizer = smollm2_tokenizer.__class__.from_pretrained(_saved(smollm2_tokenizer, tmp_path_factory))
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False),
                          AddedToken("</think>", special=False, normalized=False)])
    tokenizer.save_pretrained(out)
    assert len(tokenizer) < THINK_VOCAB_SIZE
    return str(out)


def _saved(tokenizer, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("smollm2_tokenizer")
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def think_tokenizer(think_model_dir):
    from pagoda.tokenizer.loader import load_tokenizer

    return load_tokenizer(think_model_dir)
