"""The one place that converts gRPC messages to and from the engine's dataclasses.

Modules follow the service boundaries: `sampling_params` (a request's params, split
by reader: engine fields to the scheduler and worker, text fields to the
tokenizer), `common` (logprobs, finish reasons), `scheduler` (gateway <->
scheduler, and the scheduler's block hashes), `worker` (scheduler <-> worker),
`kv_events` (scheduler -> kv-cache-manager), `tokenizer` (typed chat input).
"""
