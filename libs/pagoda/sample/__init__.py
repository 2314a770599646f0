"""Sampling: logits processing, token selection and logprobs."""
