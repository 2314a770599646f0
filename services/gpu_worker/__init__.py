"""The gpu-worker service: weights, paged KV cache, forward and sampling (see README.md)."""
