"""The model registry: every HF name is registered, unknown ones are refused by name, and
an architecture added outside the registry, settings of its own included, loads through
the normal loader."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.config import ModelArchConfig
from pagoda.model.architectures.gemma2 import GemmaSettings
from pagoda.model.architectures.llama import LlamaForCausalLM
from pagoda.model.architectures.qwen2 import Qwen2ForCausalLM
from pagoda.model.kv_cache import allocate_kv_caches
from pagoda.model.loader import load_arch_config, load_model
from pagoda.model.pooling_model import as_pooling_model
from pagoda.model.registry import MODEL_REGISTRY, ModelRegistry

SUPPORTED = ["BertForSequenceClassification", "BertModel", "DeepseekV2ForCausalLM",
             "DeepseekV3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
             "GptOssForCausalLM",
             "GraniteMoeHybridForCausalLM",
             "HF_ColBERT", "Idefics3ForConditionalGeneration",
             "LlamaForCausalLM", "LlamaModel", "LlavaForConditionalGeneration",
             "MistralForCausalLM", "MistralModel",
             "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2Model",
             "Qwen2MoeForCausalLM", "Qwen2VLForConditionalGeneration",
             "Qwen2_5_VLForConditionalGeneration",
             "Qwen3ForCausalLM", "Qwen3Model", "Qwen3MoeForCausalLM", "XLMRobertaModel"]


def write_model_dir(path, tiny_llama_dir: str, **config_changes) -> str:
    """The tiny Llama's weights (linked) under a config.json edited by `config_changes`
    (a value of None deletes the key)."""
    with open(os.path.join(tiny_llama_dir, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    os.symlink(os.path.join(tiny_llama_dir, "model.safetensors"), path / "model.safetensors")
    return str(path)


# ------------------------------------------------------------------ what is registered
def test_each_hf_name_is_registered_explicitly():
    assert MODEL_REGISTRY.supported_architectures() == SUPPORTED
    assert MODEL_REGISTRY.resolve("LlamaForCausalLM").model_cls is LlamaForCausalLM
    assert MODEL_REGISTRY.resolve("MistralForCausalLM").model_cls is LlamaForCausalLM
    assert MODEL_REGISTRY.resolve("Qwen2ForCausalLM").model_cls is Qwen2ForCausalLM
    # A bare checkpoint runs its family's class in pooling form (no LM head).
    assert MODEL_REGISTRY.resolve("MistralModel").model_cls is as_pooling_model(LlamaForCausalLM)
    assert MODEL_REGISTRY.resolve("Qwen2Model").model_cls is as_pooling_model(Qwen2ForCausalLM)
    assert MODEL_REGISTRY.supported_gguf_architectures() == ["llama", "qwen2"]


@pytest.mark.parametrize("gguf_arch,general_name,expected", [
    ("llama", "SmolLM2 135M Instruct", "LlamaForCausalLM"),
    ("llama", "Mistral 7B Instruct v0.2", "MistralForCausalLM"),  # llama.cpp writes it as llama
    ("qwen2", "Qwen2.5 0.5B Instruct", "Qwen2ForCausalLM"),
])
def test_gguf_architecture_picks_the_entry_and_its_tensor_names(gguf_arch, general_name,
                                                                expected):
    architecture, layout = MODEL_REGISTRY.resolve_gguf(gguf_arch, general_name)
    assert architecture.hf_name == expected
    assert layout.hf_tensor_name("blk.2.attn_q.bias") == "model.layers.2.self_attn.q_proj.bias"
    # llama.cpp permutes Q/K rows for its "llama" architecture only.
    assert layout.rotary_rows_permuted == (gguf_arch == "llama")


def test_first_supported_of_several_listed_architectures_wins(tmp_path, tiny_llama_dir):
    path = write_model_dir(tmp_path / "m", tiny_llama_dir,
                           architectures=["FancyNewForCausalLM", "MistralForCausalLM"])
    assert load_arch_config(path).architecture == "MistralForCausalLM"


# ------------------------------------------------------------------ unknown architectures
def test_unknown_hf_architecture_error_names_it_and_lists_the_supported(tmp_path,
                                                                        tiny_llama_dir):
    path = write_model_dir(tmp_path / "m", tiny_llama_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as error:
        load_arch_config(path)
    message = str(error.value)
    assert "['GPT2LMHeadModel'] are not supported" in message
    assert message.endswith("supported architectures: " + ", ".join(SUPPORTED))


def test_unknown_gguf_architecture_error_names_file_and_lists_the_supported(tmp_path):
    from gguf import GGUFWriter

    path = str(tmp_path / "gpt2.gguf")
    writer = GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as error:
        load_arch_config(path)
    assert str(error.value) == (f"GGUF architecture 'gpt2' is not supported; supported: "
                                f"llama, qwen2 (in {path})")


# ------------------------------------------------------------------ adding an architecture
class ThrowawayForCausalLM(LlamaForCausalLM):
    """A Llama whose config.json ties the embeddings unless it says otherwise (as Gemma's
    does): without the config hook the loader would expect an `lm_head.weight`."""


def throwaway_arch_config(hf_config: dict, arch):
    return dataclasses.replace(arch, tie_word_embeddings=hf_config.get("tie_word_embeddings",
                                                                       True))


@pytest.fixture
def throwaway_registered():
    MODEL_REGISTRY.register(ModelArchitecture("ThrowawayForCausalLM", ThrowawayForCausalLM,
                                              update_arch_config=throwaway_arch_config))
    yield
    MODEL_REGISTRY.unregister("ThrowawayForCausalLM")


def test_registered_architecture_loads_through_the_normal_loader(
        throwaway_registered, tmp_path, tiny_llama_dir, tiny_llama, paged_sequences):
    path = write_model_dir(tmp_path / "m", tiny_llama_dir,
                           architectures=["ThrowawayForCausalLM"], tie_word_embeddings=None)
    arch = load_arch_config(path)
    assert arch.architecture == "ThrowawayForCausalLM" and arch.tie_word_embeddings
    model = load_model(path, arch, torch.float32)
    assert type(model) is ThrowawayForCausalLM
    # Same weights, same network: the same logits as the Llama it derives from.
    logits = prefill_logits((model, tiny_llama), paged_sequences)
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


@dataclasses.dataclass(frozen=True)
class ScaledSettings:
    """A setting no other family has: the logits are multiplied by `logit_scale`."""

    logit_scale: float = 1.0

    @classmethod
    def from_hf_config(cls, hf_config: dict, arch) -> ScaledSettings:
        return cls(float(hf_config.get("logit_scale", 1.0)))


class ScaledForCausalLM(LlamaForCausalLM):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * family_settings(self.arch,
                                                                ScaledSettings).logit_scale


def test_a_family_declares_its_own_settings_without_touching_the_shared_config(
        tmp_path, tiny_llama_dir, tiny_llama, paged_sequences):
    MODEL_REGISTRY.register(ModelArchitecture("ScaledForCausalLM", ScaledForCausalLM,
                                              settings=ScaledSettings))
    try:
        path = write_model_dir(tmp_path / "m", tiny_llama_dir,
                               architectures=["ScaledForCausalLM"], logit_scale=2.0)
        arch = load_arch_config(path)
        model = load_model(path, arch, torch.float32)
    finally:
        MODEL_REGISTRY.unregister("ScaledForCausalLM")
    assert arch.family_settings == ScaledSettings(2.0)
    logits = prefill_logits((model, tiny_llama), paged_sequences)
    torch.testing.assert_close(logits[0], 2.0 * logits[1], atol=0, rtol=0)


def test_family_settings_default_when_absent_and_refuse_another_familys():
    arch = ModelArchConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=8)
    assert family_settings(arch, ScaledSettings) == ScaledSettings()  # a GGUF file: defaults
    arch.family_settings = ScaledSettings(3.0)
    assert family_settings(arch, ScaledSettings).logit_scale == 3.0
    with pytest.raises(TypeError, match="carries ScaledSettings, not GemmaSettings"):
        family_settings(arch, GemmaSettings)


def test_a_second_registration_of_a_name_is_refused(throwaway_registered):
    with pytest.raises(ValueError, match="'ThrowawayForCausalLM' from register\\(\\) is already"):
        MODEL_REGISTRY.register(ModelArchitecture("ThrowawayForCausalLM", LlamaForCausalLM))
    with pytest.raises(ValueError, match="'LlamaForCausalLM' .* already registered"):
        MODEL_REGISTRY.register(ModelArchitecture("LlamaForCausalLM", ThrowawayForCausalLM))


ONE_FILE_ARCHITECTURE = '''
from pagoda.model.arch_spec import ModelArchitecture, family_settings
from pagoda.config import ModelArchConfig
from pagoda.model.architectures.gemma2 import GemmaSettings
from pagoda.model.architectures.llama import LlamaForCausalLM


class OneFileForCausalLM(LlamaForCausalLM):
    pass


ARCHITECTURES = (ModelArchitecture("OneFileForCausalLM", OneFileForCausalLM),)
'''


@pytest.fixture
def make_package(tmp_path, monkeypatch):
    """Writes an importable package of the given files; forgets its modules afterwards."""
    names = []

    def make(name: str, files: dict[str, str]) -> None:
        package = tmp_path / name
        package.mkdir()
        (package / "__init__.py").write_text("")
        for filename, text in files.items():
            (package / filename).write_text(text)
        names.append(name)

    monkeypatch.syspath_prepend(str(tmp_path))
    yield make
    for module in [m for m in sys.modules if m.split(".")[0] in names]:
        del sys.modules[module]


def test_a_new_file_in_an_architecture_package_is_all_it_takes(make_package):
    make_package("extra_architectures", {
        "one_file.py": textwrap.dedent(ONE_FILE_ARCHITECTURE),
        "_helpers.py": "raise AssertionError('private modules are skipped')\n"})
    registry = ModelRegistry(packages=("pagoda.model.architectures", "extra_architectures"))
    assert "extra_architectures.one_file" not in sys.modules  # imported on first lookup only
    assert registry.resolve("OneFileForCausalLM").model_cls.__name__ == "OneFileForCausalLM"
    assert registry.supported_architectures() == sorted([*SUPPORTED, "OneFileForCausalLM"])


def test_a_module_without_a_table_is_an_error_not_a_silent_skip(make_package):
    make_package("broken_architectures", {"forgot.py": "X = 1\n"})
    registry = ModelRegistry(packages=("broken_architectures",))
    with pytest.raises(ImportError, match="broken_architectures.forgot .* no ARCHITECTURES"):
        registry.supported_architectures()


def test_a_family_that_fails_to_import_costs_only_its_own_architectures(make_package):
    make_package("mixed_architectures", {
        "one_file.py": textwrap.dedent(ONE_FILE_ARCHITECTURE),
        "needs_extra.py": "raise ImportError('No module named fancy_kernels')\n"})
    registry = ModelRegistry(packages=("mixed_architectures",))
    assert registry.resolve("OneFileForCausalLM").model_cls.__name__ == "OneFileForCausalLM"
    with pytest.raises(ValueError, match=r"mixed_architectures.needs_extra \(ImportError: No module "
                                         r"named fancy_kernels\)"):
        registry.resolve("FancyForCausalLM")


def test_importing_the_registry_imports_no_model_code():
    code = ("import sys\n"
            "import pagoda.model.registry\n"
            "loaded = [m for m in sys.modules if m == 'torch' or m.startswith('pagoda.model.arch')"
            " and m != 'pagoda.model.arch_spec']\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def prefill_logits(models, paged_sequences) -> list[torch.Tensor]:
    """Each model's logits for one 11-token prompt, prefilled over its own paged cache."""
    seqs = paged_sequences(num_blocks=8, block_size=4)
    seqs.add("a", list(range(100, 111)))
    input_ids, positions, md = seqs.step([("a", 11)])
    logits = []
    for m in models:
        kv = allocate_kv_caches(m.arch, 8, 4, torch.float32, "cpu")
        with torch.inference_mode():
            logits.append(m.compute_logits(m(input_ids, positions, kv, md)))
    return logits
