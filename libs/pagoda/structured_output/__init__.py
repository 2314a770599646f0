"""Structured outputs (constrained decoding): JSON schema, regex, choice, grammar.

Where each piece runs:
  * `pagoda.sampling_params.StructuredOutputsParams`: the request's constraint, checked
    for shape where the request enters (exactly one kind, the right types);
  * `StructuredOutputManager` (the scheduler's): the backend's own check at intake
    (a ValueError, so a 400 before anything is queued), compilation on a thread pool
    cached by the constraint's hash, a matcher per request advanced with each accepted
    token, and each step's packed bitmask for the constrained rows that sample;
  * `GrammarGate` (`scheduler_hook.py`): the scheduler's hook; it holds a constrained
    request back until its grammar compiled, adds the bitmask rows to each step's plan
    and advances the matchers;
  * the worker (`pagoda.sample.grammar`): the bitmask applied to the logits before
    sampling, so a forbidden token (EOS included, until the grammar accepts) has
    probability 0 and its logprob is -inf (vLLM applies it before its sampler too).

The package itself imports nothing, so `pagoda.config` can read the backend names
(`backend.py`) without loading the manager, which reads `pagoda.config`.
"""
