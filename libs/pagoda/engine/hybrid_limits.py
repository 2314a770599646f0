"""What a hybrid model (Mamba2 layers between attention layers) cannot run with yet.

Refused at start-up with the reason, never run wrong:
- speculative decoding (n-gram or draft): verifying k drafts advances each request's
  recurrent state over all of them, and a rejected draft's effect cannot be taken back
  without per-token state checkpoints (vLLM's hybrid n-gram corruption, #39273);
- tensor / pipeline parallelism: the Mamba2 mixer is not sharded and unverified;
- LoRA (the Mamba projections take no adapters) and the fp8 KV cache (the conv state
  lives in the cache dtype).
Prefix caching is turned off with a logged reason: a prefix-cache hit would skip the
Mamba layers' pass over the prefix, whose state is not cached per block.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def check_hybrid_model(arch, *, speculative_config, tensor_parallel_size: int,
                       pipeline_parallel_size: int, enable_lora: bool, kv_cache_dtype: str,
                       enable_prefix_caching: bool) -> bool:
    """ValueError naming the feature a hybrid `arch` cannot run with; returns whether
    prefix caching stays on (always False for a hybrid model, logged; unchanged else)."""
    if arch.mamba is None:
        return enable_prefix_caching
    name = arch.architecture
    if speculative_config:
        raise ValueError(
            f"--speculative-config is not supported for {name} (a hybrid model with Mamba2 "
            "layers): rejected draft tokens would stay in the recurrent state and change later "
            "tokens (vLLM #39273); serve it without speculative decoding")
    if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
        raise ValueError(
            f"{name}: tensor and pipeline parallelism are not supported for hybrid Mamba2 "
            "models (the Mamba2 mixer is not sharded); use tensor_parallel_size=1 and "
            "pipeline_parallel_size=1")
    if enable_lora:
        raise ValueError(f"--enable-lora is not supported for {name} (hybrid Mamba2 model)")
    if kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is not supported for {name}: its "
                         "Mamba2 conv state is kept in the cache dtype; use auto")
    if enable_prefix_caching:
        logger.warning("Prefix caching is disabled for %s: its Mamba2 layers' state is not "
                       "cached per block, so a prefix-cache hit would skip their pass over the "
                       "prefix", name)
    return False
