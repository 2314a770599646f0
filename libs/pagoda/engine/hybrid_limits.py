"""What a hybrid model (Mamba2 layers between attention layers) cannot run with yet.

Speculative decoding runs (n-gram or a draft model): verification keeps the state
after each draft and rewinds to the last accepted one (`pagoda.model.mamba2`), so a
rejected draft leaves nothing in the recurrent state (vLLM's hybrid n-gram corruption,
#39273); a hybrid *draft* model is refused (its own state would need the same rewind).

Refused at start-up with the reason, never run wrong:
- tensor / pipeline parallelism: the Mamba2 mixer is not sharded and unverified;
- LoRA (the Mamba projections take no adapters) and the fp8 KV cache (the conv state
  lives in the cache dtype).
Prefix caching keeps recurrent-state checkpoints at block boundaries
(`pagoda.core.state_checkpoints`): a hit goes only as far as a block whose state was
saved, so no hit skips the Mamba layers' pass over the prefix. Its cost: `max_num_seqs`
checkpoint slots beside the running requests' in every Mamba layer's pool (as much
state memory again), taken from the KV budget; --no-enable-prefix-caching gives it back.
KV transfers (P/D roles, the prefix pull) are refused by the worker's KV geometry
(`pagoda.kv_transfer.block_shares.runner_geometry`): a producer or consumer replica
fails at start-up, a colocated one serves without transfers. Preemption and migration
carry the state by recompute: the request starts at token 0 and its whole context
(prompt + generated tokens) rebuilds the state in a zeroed slot.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def check_hybrid_model(arch, *, tensor_parallel_size: int,
                       pipeline_parallel_size: int, enable_lora: bool, kv_cache_dtype: str,
                       enable_prefix_caching: bool, async_scheduling: bool = False) -> bool:
    """ValueError naming the feature a hybrid `arch` cannot run with; returns whether
    prefix caching stays on (unchanged: a hybrid model's runs on state checkpoints)."""
    if arch.mamba is None:
        return enable_prefix_caching
    name = arch.architecture
    if tensor_parallel_size > 1 or pipeline_parallel_size > 1:
        raise ValueError(
            f"{name}: tensor and pipeline parallelism are not supported for hybrid Mamba2 "
            "models (the Mamba2 mixer is not sharded); use tensor_parallel_size=1 and "
            "pipeline_parallel_size=1")
    if enable_lora:
        raise ValueError(f"--enable-lora is not supported for {name} (hybrid Mamba2 model)")
    if async_scheduling:
        # Not verified: a step sent ahead advances the recurrent state of a request that
        # may have ended, or been preempted, in the step before it.
        raise ValueError(f"--async-scheduling is not supported for {name} (hybrid Mamba2 "
                         "model): its per-request state is not reconciled with steps sent "
                         "ahead")
    if kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} is not supported for {name}: its "
                         "Mamba2 conv state is kept in the cache dtype; use auto")
    if enable_prefix_caching:
        logger.info("Prefix caching for %s keeps its Mamba2 layers' state at block "
                    "boundaries: a hit ends at the last block with a saved state", name)
    return enable_prefix_caching


def check_draft_model(draft_arch) -> None:
    """ValueError for a hybrid draft model: the draft runner keeps no recurrent state."""
    if draft_arch.mamba is not None:
        raise ValueError(f"--speculative-config: a hybrid draft model ({draft_arch.architecture}, "
                         "Mamba2 layers) is not supported; use an attention-only draft model or "
                         '{"method": "ngram"}')
