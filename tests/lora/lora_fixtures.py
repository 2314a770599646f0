"""Random PEFT adapters for the LoRA tests (the `adapters` fixture and tests that need
one of their own)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: str, out_dir: str, seed: int, rank: int = 8,
                 targets: list[str] = TARGETS) -> str:
    """A PEFT LoRA adapter with random A and B (B scaled up so the adapter visibly
    changes greedy tokens), saved as adapter_config.json + adapter_model.safetensors."""
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
