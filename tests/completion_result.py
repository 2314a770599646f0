"""What one completion answered through the `openai` client, streamed or not."""

from __future__ import annotations


def completion_result(client, stream: bool, **kwargs) -> tuple:
    """(text, finish_reason, stop_reason, completion_tokens) of one completion of the
    first choice: the same four whether it came whole or as chunks (their text joined,
    the usage from the usage chunk), so a test can compare the two."""
    if not stream:
        out = client.completions.create(**kwargs)
        choice = out.choices[0]
        return choice.text, choice.finish_reason, choice.model_extra["stop_reason"], \
            out.usage.completion_tokens
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    last = [c.choices[0] for c in chunks if c.choices][-1]
    return ("".join(c.choices[0].text for c in chunks if c.choices), last.finish_reason,
            last.model_extra["stop_reason"], chunks[-1].usage.completion_tokens)
