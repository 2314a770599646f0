"""Sampling: logits processing, token selection and logprobs.

- `metadata.SamplingMetadata`: one step's per-row inputs (the runner/sampler contract).
- `builder`: `build_sampling_metadata(...)` from SamplingParams, `make_generator(seed)`.
- `sampler.Sampler`: logits [B, V] + metadata -> `SamplerOutput` (tokens, logprobs).
- `processors` (logit_bias, min_tokens), `penalties`, `truncation` (temperature,
  top-k, top-p, min-p): the steps the sampler runs, each usable on its own.
- `logprobs.compute_topk_logprobs`: chosen-token + top-k logprobs, also for prompts.
"""
