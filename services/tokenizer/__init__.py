"""The tokenizer service: encode, chat template, streaming decode (see README.md)."""
