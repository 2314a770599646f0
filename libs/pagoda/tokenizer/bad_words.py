"""vLLM's `bad_words`: words -> the token sequences the sampler bans.

A word is encoded twice, as written (leading spaces dropped) and with one leading
space, because most tokenizers spell a word differently at the start of the text and
after a space. The spaced form is kept only when it is a different word token of the
same length (vLLM's rule: `SamplingParams.update_from_tokenizer`). The offline engine
encodes with its tokenizer; the gateway asks the tokenizer service for each text of
`bad_word_texts` and hands the results back through `encode`, so both apply one rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def bad_word_texts(bad_words: Sequence[str]) -> list[str]:
    """The texts `bad_words_token_ids` encodes, each once, in order."""
    texts: dict[str, None] = {}
    for word in bad_words:
        texts[word.lstrip()] = None
        texts[" " + word.lstrip()] = None
    return list(texts)


def bad_words_token_ids(bad_words: Sequence[str], encode: Callable[[str], list[int]],
                        vocab_size: int | None = None) -> list[list[int]]:
    """`encode(text)` gives a text's token ids without special tokens. A word that
    encodes to nothing (only whitespace) bans nothing. ValueError (vLLM's message)
    for ids outside a vocabulary of `vocab_size` tokens."""
    sequences: list[list[int]] = []
    for word in bad_words:
        plain = list(encode(word.lstrip()))
        if plain:
            sequences.append(plain)
        spaced = list(encode(" " + word.lstrip()))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            sequences.append(spaced)
    if vocab_size is not None:
        invalid = [t for seq in sequences for t in seq if not 0 <= t < vocab_size]
        if invalid:
            raise ValueError(f"The model vocabulary size is {vocab_size}, but the following "
                             f"tokens were specified as bad: {invalid}. All token id values "
                             f"should be integers satisfying: 0 <= token_id < {vocab_size}.")
    return sequences
