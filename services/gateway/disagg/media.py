"""Which media items a P/D decode replica gets: without their pixels when it can do
without them.

The prefill replica gets the prompt's items with their data (it encodes them and
computes the prompt's KV, leased to the decode side in whole blocks). The decode
replica gets the same items, identifiers and runs unchanged (its block hashes must
equal the prefill side's, `pagoda.core.block_hash.mm_block_keys`), but without data
when the lease covers every item's placeholder run: it imports those blocks and never
encodes. A run that reaches past the leased blocks (into the prompt's partial last
block, which no lease holds) would have to be computed on the decode side, so then it
gets the data too, as in a colocated prefill (correct, only not free of pixels). If
the decode side still has to compute inside a data-less run (its pull failed, a
preemption), its scheduler refuses the request (`pagoda.core.media_guard`): an error,
never an answer computed without the image.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagoda.kv_transfer.params import KVTransferParams
from pagoda.multimodal.inputs import MultiModalFeature


def decode_side_features(features: Sequence[MultiModalFeature], params: KVTransferParams,
                         block_size: int) -> list[MultiModalFeature]:
    """`features` without data where the lease in `params` covers all their runs;
    unchanged otherwise (or when there are none)."""
    leased_tokens = len(params.block_hashes) * block_size
    if not features or any(f.end > leased_tokens for f in features):
        return list(features)
    if any(f.data is not None and "image_grid_thw" in f.data for f in features):
        # M-RoPE (Qwen2-VL): the decode side computes every position from the grids.
        return list(features)
    return [f.without_data() for f in features]
