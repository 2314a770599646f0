"""What one request from outside may ask of the cluster: the per-request limits and
their flags (`request_limits.py`, each breach a 400 naming the flag) and the body-size
limit applied before any of the body is parsed (`body_limit.py`, a 413)."""
