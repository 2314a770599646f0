"""Speculative decoding (vLLM's `--speculative-config`): cheap draft tokens proposed
for a request, verified by the target model in one step, accepted so the output keeps
the target's distribution (`pagoda.sample.rejection_sampler`)."""
