"""KV blocks that move between replicas at the gateway's request: prefill/decode
disaggregation, one choice over a prefill and a decode replica with its handshake
(`prefill_decode.py`), and the cluster-wide prefix cache, `--kv-prefix-pull`, where a
replica pulls the cached prompt blocks another one holds (`prefix_pull.py`). Either way
the transfer itself is the replicas' (kv_transfer); the gateway only pairs them."""
