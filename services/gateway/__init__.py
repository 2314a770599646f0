"""The gateway service: the OpenAI-compatible HTTP API (see README.md)."""
