"""A transformers model with random weights for exactness checks (tests and
benchmarks/gpu_check): not for serving.

transformers initialises norms to one and attention sinks and biases to zero, which would
let a wrong handling of them pass unseen; here they are visibly random. Invariant: the
weights depend only on the config (torch's global seed is set to 0 before the init), so
two callers building the same config get the same bits.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def random_hf_model(config):
    """fp32, eager attention, in eval mode on the CPU; `config`'s initializer_range is
    set to 0.2 and its eos_token_id to None (greedy runs to max tokens)."""
    config.initializer_range = 0.2
    config.eos_token_id = None
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                             attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("self_attn.sinks"):
                p.copy_(2.0 * torch.randn_like(p))
            elif name.endswith(("_bias", "e_score_correction_bias")):
                p.copy_(0.5 * torch.randn_like(p))
    return model.eval()
