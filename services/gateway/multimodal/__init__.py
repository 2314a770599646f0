"""The gateway's room for media in chat requests (cheap checks; the tokenizer loads)."""
