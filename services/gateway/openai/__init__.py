"""The OpenAI-compatible API: /v1/completions and /v1/chat/completions (`routes.py`),
their request bodies (`request_models.py`, vLLM's prompt-side fields in
`request_fields.py`), the answers they send (`completion_bodies.py` whole,
`completion_chunks.py` streamed, `logprobs.py` in its three shapes), what shapes a chat
answer (`chat_output.py`: reasoning, tool calls; `tools.py` and `tool_parsers/` for
tool calling; `structured_outputs.py` for the constraint fields), /tokenize and
/detokenize, and OpenAI's Responses API (`responses_api/`). Everything here speaks
HTTP and JSON; what reaches a replica goes through `generation/` and `routing/`."""
