"""Who may call the gateway: the API key (`--api-key`, `api_key.py`), checked in
constant time on every route but the probes, the docs and (unless
`--metrics-require-key`) `/metrics`, before any body is read."""
