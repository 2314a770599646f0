"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) on the chat
completions path: request models, conversion to a chat request, response and stream
encoding, Anthropic's error shape."""
