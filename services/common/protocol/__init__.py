"""The one place that converts gRPC messages to and from the engine's dataclasses.

Modules follow the service boundaries: `common` (sampling params, logprobs,
finish reasons), `scheduler` (gateway <-> scheduler), `worker` (scheduler <->
worker), `kv_events` (scheduler -> kv-cache-manager). Tokenizer messages carry
only plain values and are built where they are used.
"""
