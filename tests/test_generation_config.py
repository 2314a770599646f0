"""`pagoda.generation_config`: a model's recommended sampling settings become the defaults
of requests that leave them unset (vLLM's --generation-config), offline too."""

from __future__ import annotations

import json
import shutil

import pytest

from pagoda import LLM, SamplingParams
from pagoda.generation_config import (default_max_tokens, load_generation_defaults,
                                      parse_override)

LLAMA3_STYLE = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True,
                "temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64,
                "top_k": 50, "repetition_penalty": 1.0}  # the last two: transformers' defaults


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(LLAMA3_STYLE))
    return str(tmp_path)


def test_auto_reads_the_model_folder(model_dir):
    # Values equal to transformers' defaults are no recommendation (vLLM never sees them).
    assert load_generation_defaults(model_dir) == {"temperature": 0.6, "top_p": 0.9,
                                                   "max_tokens": 64}


def test_vllm_means_none_and_overrides_still_apply(model_dir):
    assert load_generation_defaults(model_dir, "vllm") == {}
    assert load_generation_defaults(model_dir, "vllm", {"temperature": 0.2}) == \
        {"temperature": 0.2}
    assert load_generation_defaults(model_dir, "auto", parse_override('{"top_p": 0.5}'))["top_p"] \
        == 0.5


def test_a_folder_elsewhere(tmp_path, model_dir):
    other = tmp_path / "other"
    other.mkdir()
    assert load_generation_defaults(str(other), model_dir)["temperature"] == 0.6
    with pytest.raises(ValueError, match="neither 'auto', 'vllm' nor a folder"):
        load_generation_defaults(model_dir, str(tmp_path / "missing"))


def test_no_file_or_a_gguf_model_has_no_defaults(tmp_path):
    assert load_generation_defaults(str(tmp_path)) == {}
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert load_generation_defaults(str(gguf)) == {}


def test_bad_input_is_named(tmp_path, model_dir):
    with pytest.raises(ValueError, match="unknown field 'temprature'"):
        load_generation_defaults(model_dir, "auto", {"temprature": 0.1})
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_override("[1]")
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_generation_defaults(str(tmp_path))


def test_default_max_tokens_is_capped_by_the_context():
    assert default_max_tokens({"max_tokens": 64}, remaining=100) == 64
    assert default_max_tokens({"max_tokens": 64}, remaining=10) == 10
    assert default_max_tokens({}, remaining=10) == 10


def test_llm_uses_the_model_defaults_and_its_max_logprobs(tmp_path, tiny_llama_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0,
                                                              "max_new_tokens": 3}))
    llm = LLM(model=str(model), dtype="float32", block_size=4, max_model_len=128,
              max_logprobs=2)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=3)
    [implicit] = llm.generate("a b c", use_tqdm=False)
    [greedy] = llm.generate("a b c", SamplingParams(temperature=0, max_tokens=3),
                            use_tqdm=False)
    assert implicit.outputs[0].token_ids == greedy.outputs[0].token_ids
    with pytest.raises(ValueError, match="maximum allowed, 2"):
        llm.generate("a", SamplingParams(logprobs=3), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
