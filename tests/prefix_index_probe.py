"""What the cluster's prefix index says about a prompt, asked the way the gateway asks:
the tokenizer's block hashes of the prompt, then the kv-cache-manager's LookupPrefix."""

from __future__ import annotations

import grpc

from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2 as kpb
from pagoda.services._proto.pagoda.kv_cache_manager.v1 import kv_cache_manager_pb2_grpc as kpb_grpc
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as tpb
from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as tpb_grpc


def indexed_blocks(tokenizer_addr: str, index_addr: str, model: str, prompt: list[int],
                   block_size: int) -> dict[str, int]:
    """instance id -> leading blocks of `prompt` the cluster index says it holds."""
    with grpc.insecure_channel(tokenizer_addr) as channel:
        hashes = tpb_grpc.TokenizerServiceStub(channel).Tokenize(tpb.TokenizeRequest(
            token_ids=tpb.TokenIds(token_ids=prompt), block_size=block_size),
            timeout=10).block_hashes
    with grpc.insecure_channel(index_addr) as channel:
        reply = kpb_grpc.KvCacheManagerServiceStub(channel).LookupPrefix(
            kpb.LookupPrefixRequest(model=model, block_size=block_size, block_hashes=hashes),
            timeout=10)
    return dict(reply.num_cached_blocks)
