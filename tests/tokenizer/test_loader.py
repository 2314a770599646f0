"""load_tokenizer: from an HF directory or a GGUF file, with the chat template, cached."""

from __future__ import annotations

import os

import pytest

from pagoda.tokenizer.loader import load_tokenizer

MESSAGES = [{"role": "user", "content": "Hi there"}]


def test_gguf_tokenizer_has_smollm2_chat_template(smollm2_gguf_path, smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                                 add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2_tokenizer.eos_token == "<|im_end|>" and len(smollm2_tokenizer) == 49152
    # Rebuilding from GGUF takes seconds: a second load is the cached instance (the
    # session fixture's own instance may have left the small LRU in a long run).
    first = load_tokenizer(smollm2_gguf_path)
    assert load_tokenizer(smollm2_gguf_path) is first
    assert load_tokenizer(os.path.dirname(smollm2_gguf_path)) is first
    assert first.get_vocab() == smollm2_tokenizer.get_vocab()


def test_directory_tokenizer_equals_the_gguf_one(tiny_llama_dir, smollm2_tokenizer):
    tok = load_tokenizer(tiny_llama_dir)
    text = "The quick brown fox, 123 <|im_end|> émoji 🙂"
    assert tok(text).input_ids == smollm2_tokenizer(text).input_ids
    assert (tok.apply_chat_template(MESSAGES, tokenize=False)
            == smollm2_tokenizer.apply_chat_template(MESSAGES, tokenize=False))


def test_explicit_tokenizer_path_wins(tmp_path, tiny_llama_dir, smollm2_gguf_path,
                                      smollm2_tokenizer):
    explicit = load_tokenizer(str(tmp_path), tokenizer=smollm2_gguf_path)
    assert explicit is load_tokenizer(smollm2_gguf_path)
    assert explicit.get_vocab() == smollm2_tokenizer.get_vocab()
    with pytest.raises(ValueError, match="No tokenizer"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))
