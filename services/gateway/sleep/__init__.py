"""vLLM's sleep mode endpoints (routes.py)."""
