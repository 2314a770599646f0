"""Random PEFT adapters on the tiny Llama (tests/conftest.py `tiny_llama_dir`)."""

from __future__ import annotations

import pytest
import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: str, out_dir: str, seed: int, rank: int = 8,
                 targets: list[str] = TARGETS) -> str:
    """A PEFT LoRA adapter with random A and B (B scaled up so the adapter visibly
    changes greedy tokens), saved as adapter_config.json + adapter_model.safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                        init_lora_weights=False, lora_dropout=0.0)
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def adapters(tiny_llama_dir, tmp_path_factory) -> list[str]:
    """Three adapters: two on every projection (ranks 8 and 4), one on attention only."""
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(tiny_llama_dir, str(root / "a1"), seed=1, rank=8),
            make_adapter(tiny_llama_dir, str(root / "a2"), seed=2, rank=4),
            make_adapter(tiny_llama_dir, str(root / "a3"), seed=3, rank=8,
                         targets=["q_proj", "v_proj"])]
