"""Which RoPE scalings Pagoda runs, and a checkpoint's scaling in one form.

Torch-free (config reading only), so that a process that reads a model's
architecture without running it (the tokenizer service) does not import torch;
`pagoda.model.rotary` computes the frequencies.
"""

from __future__ import annotations

# rope_type values understood by `rope_frequencies` (None / "default" is plain RoPE).
# "freq_factors" is GGUF's form of Llama-3 scaling: llama.cpp stores the per-frequency
# divisors as a `rope_freqs.weight` tensor instead of the HF parameters.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "freq_factors", "yarn",
                        "longrope")
# Older names transformers still reads: Phi-3's first release called longrope "su".
_ROPE_TYPE_ALIASES = {"su": "longrope"}


def normalize_rope_scaling(rope: dict | None) -> dict | None:
    """HF `rope_scaling` / `rope_parameters` -> a dict with `rope_type`, or None for plain RoPE.

    Accepts the old key `type` (and old type names) and drops `rope_theta` (carried
    separately). Raises ValueError for a rope type we do not implement, rather than
    silently running the model with wrong positions.
    """
    if not rope:
        return None
    rope = dict(rope)
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope_type = _ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    rope.pop("type", None)
    rope.pop("rope_theta", None)
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"Unsupported rope scaling type {rope_type!r}; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return {"rope_type": rope_type, **rope}
