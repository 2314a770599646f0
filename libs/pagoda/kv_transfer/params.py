"""`KVTransferParams`: what travels with a disaggregated request (vLLM's
`kv_transfer_params`, typed). Plain data: `pagoda.messages` imports it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVTransferParams:
    """Prefill request: only `do_remote_decode`. Prefill answer / decode request:
    where the prompt's full blocks are (`remote_block_ids[i]` holds the block whose
    hash is `block_hashes[i]`, block i of the prompt) and the lease pinning them
    until `lease_expiry` (Unix seconds) in the prefill scheduler's `remote_epoch`."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_instance_id: str = ""
    remote_scheduler_address: str = ""
    remote_worker_address: str = ""
    remote_epoch: str = ""
    remote_worker_epoch: str = ""
    lease_id: str = ""
    lease_expiry: float = 0.0
    block_hashes: list[bytes] = field(default_factory=list)
    remote_block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # the prefill replica's prefix-cache hit
