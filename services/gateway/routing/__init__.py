"""Which scheduler replica serves a request, and the gRPC peers it is chosen from: the
peers and their health and load polling (`peers.py`), where replicas are
(`discovery.py`, `discovery_k8s.py`), the policies and kv_aware cost (`router.py`), the
prefix index it consults (`prefix_index.py`), adapter placement (`lora_placement.py`),
the start-up block-hash self-check (`block_hash_check.py`), route + retry of one
request's streams (`dispatch.py`) and the per-request routing context with its
`X-Pagoda-Instance` header (`context.py`)."""
