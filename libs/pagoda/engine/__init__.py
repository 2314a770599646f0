"""The engine loop: requests in, token deltas out (no detokenization here)."""
