"""Tokenizer side of the engine: loading, chat templates, incremental detokenization."""
