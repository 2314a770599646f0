"""vLLM's `truncate_prompt_tokens` for generation: keep the prompt's *last* N tokens.

A generation prompt is cut on the left (vLLM's tokenizer truncation side for the
generate task): the end of a prompt, where the question usually is, survives. The
prompt is encoded whole first, then cut, so the kept tokens are exactly the last N
of the untruncated encoding (special tokens included: a cut BOS stays cut). -1 means
the model's context length. The offline engine and the gateway both call this.
"""

from __future__ import annotations

from collections.abc import Sequence


def resolve_truncation(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """The number of tokens to keep (None: no truncation); ValueError with vLLM's
    message when it exceeds the context length."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens <= -1:
        return max_model_len
    if truncate_prompt_tokens > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({truncate_prompt_tokens}) is greater "
                         f"than max_model_len ({max_model_len}). Please, select a smaller "
                         f"truncation size.")
    return truncate_prompt_tokens


def truncate_prompt(token_ids: Sequence[int], truncate_prompt_tokens: int | None,
                    max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (all of it when shorter)."""
    keep = resolve_truncation(truncate_prompt_tokens, max_model_len)
    token_ids = list(token_ids)
    return token_ids if keep is None or keep >= len(token_ids) else token_ids[-keep:]
