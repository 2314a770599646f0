"""Helpers every service shell shares: logging, the gRPC server lifecycle, /metrics."""
