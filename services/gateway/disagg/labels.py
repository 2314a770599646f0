"""The label values of the gateway's prefill/decode counters, in a leaf module so that the
metrics (which export every series at 0 from start-up) and the code that counts share them.

Invariant: a value counted by services/gateway/disagg is one of these tuples.
"""

# The layout fields two replicas must agree on to exchange KV blocks.
HANDSHAKE_FIELDS = ("kv_dtype", "block_size", "num_layers", "num_kv_heads", "head_dim",
                    "layout", "prefix_hash_seed")
# pagoda_gateway_disagg_handshake_mismatches_total{field}
HANDSHAKE_MISMATCH_FIELDS = ("model", "kv_connector", "device_type", *HANDSHAKE_FIELDS)
# pagoda_gateway_disagg_fallbacks_total{kind}
DISAGG_FALLBACK_KINDS = ("no_prefill_replica", "prefill_failed", "media_recompute")
