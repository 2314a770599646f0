"""What one request from outside may ask of the cluster: each limit a flag, each breach a
400 (413 for the body) whose message names the limit and the flag that sets it.

    --max-request-body-bytes   body size (413; checked before the body is read)
    --max-prompts-per-request  prompts of one completions request
    --max-choices-per-request  prompts x n
    --max-stop-strings, --max-stop-string-length, --max-stop-token-ids
    --max-logit-bias-entries   (logprobs: --max-logprobs, serving_options.py)
    --max-messages             messages of one chat request
    (and nesting: the free-form JSON fields, `chat_template_kwargs`, `tools`, a message's
    own keys, at most MAX_JSON_DEPTH deep)
    --limit-concurrency        uvicorn's: connections past it are answered 503

Defaults are generous (vLLM sets none of these): a request a real client sends never
meets them; a request built to exhaust memory or CPU does.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from pagoda.services.gateway.errors import APIError


MAX_JSON_DEPTH = 32


@dataclass(frozen=True)
class RequestLimits:
    """Invariant: every field is a positive bound (the flags refuse anything else)."""

    max_request_body_bytes: int = 32 * 1024 * 1024
    max_prompts_per_request: int = 1024
    max_choices_per_request: int = 1024
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    max_stop_token_ids: int = 1024
    max_logit_bias_entries: int = 1024
    max_bad_words: int = 1024
    max_messages: int = 4096
    limit_concurrency: int = 4096

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RequestLimits":
        return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})

    # ------------------------------------------------------------ checks
    def check_sampling(self, body: Any, num_prompts: int) -> None:
        """The sampling fields both APIs share (`openai_models.SamplingFields`)."""
        choices = num_prompts * body.n
        self._at_most(choices, self.max_choices_per_request, "n",
                      f"{num_prompts} prompt(s) x n={body.n} = {choices} completions",
                      "max-choices-per-request")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        self._at_most(len(stop), self.max_stop_strings, "stop",
                      f"{len(stop)} stop strings", "max-stop-strings")
        longest = max((len(s) for s in stop if isinstance(s, str)), default=0)
        self._at_most(longest, self.max_stop_string_length, "stop",
                      f"a stop string of {longest} characters", "max-stop-string-length")
        self._at_most(len(body.stop_token_ids or ()), self.max_stop_token_ids, "stop_token_ids",
                      f"{len(body.stop_token_ids or ())} stop token ids", "max-stop-token-ids")
        self._at_most(len(body.logit_bias or {}), self.max_logit_bias_entries, "logit_bias",
                      f"{len(body.logit_bias or {})} logit_bias entries",
                      "max-logit-bias-entries")
        # Checked before the words are tokenized: each is a tokenizer call, and every
        # step of the batch then checks the request's words.
        self._at_most(len(body.bad_words or ()), self.max_bad_words, "bad_words",
                      f"{len(body.bad_words or ())} bad words", "max-bad-words")

    def check_prompts(self, num_prompts: int, param: str = "prompt") -> None:
        """Completions' prompts, or a pooling request's inputs (`param` "input")."""
        self._at_most(num_prompts, self.max_prompts_per_request, param,
                      f"{num_prompts} prompts", "max-prompts-per-request")

    def check_messages(self, messages: list, name: str = "messages", **free_form: Any) -> None:
        """The message count, and the nesting of the messages (the field `name`) and of
        the free-form JSON fields."""
        self._at_most(len(messages), self.max_messages, name,
                      f"{len(messages)} messages", "max-messages")
        for param, value in {name: messages, **free_form}.items():
            if json_depth(value, MAX_JSON_DEPTH + 1) > MAX_JSON_DEPTH:
                raise APIError(f"{param} is nested more than {MAX_JSON_DEPTH} levels deep.",
                               param=param)

    @staticmethod
    def _at_most(value: int, limit: int, param: str, what: str, flag: str) -> None:
        if value > limit:
            raise APIError(f"The request asks for {what}; this server allows at most "
                           f"{limit} (--{flag}).", param=param)


def json_depth(value: Any, stop_at: int) -> int:
    """How deeply `value` nests lists and objects (a scalar: 0), counted no further
    than `stop_at` (so a hostile value costs no more than the bound)."""
    depth, level = 0, [value]
    while level and depth < stop_at:
        children = []
        for item in level:
            if isinstance(item, dict):
                children.extend(item.values())
            elif isinstance(item, (list, tuple)):
                children.extend(item)
        if not children and not any(isinstance(i, (dict, list, tuple)) for i in level):
            break
        depth += 1
        level = children
    return depth


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Request limits (a request past one gets a 400; "
                                      "past the body size, a 413)")
    d = RequestLimits()
    helps = {
        "max_request_body_bytes": "Largest request body, in bytes.",
        "max_prompts_per_request": "Most prompts in one completions request, or inputs "
                                   "(texts, pairs, documents) in one pooling request.",
        "max_choices_per_request": "Most completions one request may ask for (prompts x n).",
        "max_stop_strings": "Most stop strings per request.",
        "max_stop_string_length": "Longest stop string, in characters.",
        "max_stop_token_ids": "Most stop token ids per request.",
        "max_logit_bias_entries": "Most logit_bias entries per request.",
        "max_bad_words": "Most bad_words per request.",
        "max_messages": "Most messages in one chat request.",
        "limit_concurrency": "Most connections served at once (uvicorn's "
                             "--limit-concurrency); more are answered 503.",
    }
    for f in fields(RequestLimits):
        group.add_argument(f"--{f.name.replace('_', '-')}", type=_positive_int,
                           default=getattr(d, f.name), help=helps[f.name])


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return number
