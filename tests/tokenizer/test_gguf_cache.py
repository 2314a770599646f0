"""A GGUF file's tokenizer is converted once per machine and read back identical."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import transformers

from pagoda.tokenizer import gguf_cache

TEXTS = ["Hello world", "  spaces\n\ttabs", "émoji 🤖 and 中文", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def conversions(monkeypatch):
    """How many times transformers was asked to convert a GGUF tokenizer."""
    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def counting(path, *args, **kwargs):
        if "gguf_file" in kwargs:
            calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", counting)
    return calls


def same(a, b) -> bool:
    return (all(a.encode(t) == b.encode(t) for t in TEXTS)
            and a.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            and a.all_special_tokens == b.all_special_tokens and a.get_vocab() == b.get_vocab())


def test_the_second_load_reads_the_conversion_back(cache, conversions, smollm2_gguf_path):
    first = gguf_cache.load_gguf_tokenizer(smollm2_gguf_path)
    assert len(conversions) == 1
    assert (gguf_cache.entry_dir(smollm2_gguf_path) / "tokenizer.json").exists()
    second = gguf_cache.load_gguf_tokenizer(smollm2_gguf_path)
    assert len(conversions) == 1  # read from the cache, not converted again
    assert same(first, second)


def test_a_broken_entry_is_converted_again(cache, conversions, smollm2_gguf_path):
    good = gguf_cache.load_gguf_tokenizer(smollm2_gguf_path)
    entry = gguf_cache.entry_dir(smollm2_gguf_path)
    (entry / "tokenizer.json").write_text("{not json")
    again = gguf_cache.load_gguf_tokenizer(smollm2_gguf_path)
    assert len(conversions) == 2
    assert same(good, again)


def test_a_changed_file_has_another_entry(cache, tmp_path, smollm2_gguf_path):
    copy = tmp_path / "model.gguf"
    shutil.copyfile(smollm2_gguf_path, copy)
    before = gguf_cache.entry_dir(str(copy))
    os.utime(copy, ns=(1, 1))
    assert gguf_cache.entry_dir(str(copy)) != before


def test_an_unwritable_cache_still_gives_the_tokenizer(tmp_path, monkeypatch, smollm2_gguf_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(blocker))
    assert gguf_cache.load_gguf_tokenizer(smollm2_gguf_path).encode("Hello world")


def test_an_entry_read_with_the_fast_class_equals_autotokenizers(cache, smollm2_gguf_path):
    """A stored conversion is read with PreTrainedTokenizerFast itself, skipping
    AutoTokenizer (its model registry, and torch): the same class, arguments, rules."""
    gguf_cache.load_gguf_tokenizer(smollm2_gguf_path)  # stores the entry
    entry = str(gguf_cache.entry_dir(smollm2_gguf_path))
    direct = gguf_cache.load_gguf_tokenizer(smollm2_gguf_path)
    auto = transformers.AutoTokenizer.from_pretrained(entry)
    assert type(direct) is type(auto)
    assert direct.init_kwargs == auto.init_kwargs
    assert direct.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert direct.chat_template == auto.chat_template and same(direct, auto)
    code = ("import sys; from pagoda.tokenizer.gguf_cache import load_gguf_tokenizer; "
            f"load_gguf_tokenizer({smollm2_gguf_path!r}); "
            "print(sorted(m for m in ('torch', 'transformers.models') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PAGODA_CACHE_DIR": str(cache)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
