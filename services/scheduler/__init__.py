"""The scheduler service: one model replica's queue, batching and blocks (see README.md)."""
