"""The prompt forms `LLM`'s methods accept, normalised (vLLM's `PromptType`, text only)."""

from __future__ import annotations

from typing import Any, Sequence

Prompt = str | dict[str, Any] | list[int]


def as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def normalize_prompt(prompt: Prompt) -> tuple[str | None, list[int] | None, str | None]:
    """(text, token ids, cache salt); text or ids may be None."""
    if isinstance(prompt, str):
        return prompt, None, None
    if isinstance(prompt, dict):
        salt = prompt.get("cache_salt")
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"]), salt
        if "prompt" in prompt:
            return prompt["prompt"], None, salt
        raise ValueError("A prompt dict needs 'prompt' or 'prompt_token_ids'.")
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt), None
    raise ValueError(f"Unsupported prompt type: {type(prompt).__name__}")
