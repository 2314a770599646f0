"""A tokenizer replica of the default GGUF model starts without torch (seconds of CPU
per replica at a cluster's start, on the cores the gpu-worker loads on), with the same
end-of-sequence ids the engine reads."""

from __future__ import annotations

import subprocess
import sys

from pagoda.model.loader import load_arch_config
from pagoda.model.model_path import eos_token_ids


def test_the_default_models_tokenizer_service_builds_without_torch():
    """What `pagoda tokenizer` builds before it serves (the tokenizer, the media
    preprocessor): no torch; a text-only model's architecture, which only its refusal
    of media names, is looked up when media come."""
    code = ("import sys; from pagoda.services.cli.main import build_parser; "
            "from pagoda.services.tokenizer.server import build_media, build_servicer; "
            "args = build_parser('tokenizer').parse_args(['tokenizer']); "
            "s = build_servicer(None); build_media(s, args); s.tokenizer.encode('Hello'); "
            "print(s.eos_token_ids, sorted(m for m in ('torch', 'transformers.models') "
            "if m in sys.modules)); "
            "print(s.media.architecture)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    before, architecture = out.stdout.strip().splitlines()
    assert before.endswith("[]"), out.stdout
    assert architecture == "LlamaForCausalLM"


def test_a_ggufs_eos_ids_from_its_metadata_equal_the_engines(smollm2_gguf_path,
                                                              tiny_llama_dir):
    assert eos_token_ids(smollm2_gguf_path) == load_arch_config(smollm2_gguf_path).eos_token_ids
    assert eos_token_ids(smollm2_gguf_path)  # SmolLM2 names its end-of-turn token
    assert eos_token_ids(str(tiny_llama_dir)) == \
        load_arch_config(str(tiny_llama_dir)).eos_token_ids
