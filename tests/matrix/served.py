"""The request set through a served path with the official `openai` client.

Every request asks for logprobs with `return_tokens_as_token_ids` (vLLM's), so each
sampled token comes back as `token_id:N` with its logprob and top logprobs: the matrix
compares token ids, not only text."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

from compare import Answer, Choice
from request_set import TOP_LOGPROBS, MatrixRequest

# The openai client's own keyword arguments; everything else travels in extra_body.
_NATIVE = {"temperature", "seed", "n", "max_tokens", "stop"}


def openai_body(request: MatrixRequest) -> dict[str, Any]:
    """The request's OpenAI body (without `model`)."""
    body: dict[str, Any] = dict(request.params)
    if request.messages:
        body.update(messages=request.messages, logprobs=True, top_logprobs=TOP_LOGPROBS)
        if request.tools:
            body.update(tools=request.tools, tool_choice=request.tool_choice)
    else:
        body.update(prompt=request.prompt, logprobs=TOP_LOGPROBS)
    if request.json_schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "answer", "schema": request.json_schema}}
    body["return_tokens_as_token_ids"] = True
    return {**body, **request.extra}


def client(url: str, timeout: float = 300, headers: dict[str, str] | None = None
           ) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=timeout,
                         default_headers=headers)


def _id(token: str) -> int:
    assert token.startswith("token_id:"), token
    return int(token.split(":", 1)[1])


def send(api: openai.OpenAI, request: MatrixRequest, model: str = "tiny",
         stream: bool = False) -> Answer:
    """One request: its answer with token ids and logprobs (`stream`: streamed)."""
    if stream:
        return send_streamed(api, request, model)
    body = openai_body(request)
    native = {k: body.pop(k) for k in list(body) if k in _NATIVE}
    if request.messages:
        kwargs = {k: body.pop(k) for k in ("messages", "logprobs", "top_logprobs", "tools",
                                           "tool_choice", "response_format") if k in body}
        reply = api.chat.completions.create(model=model, **native, **kwargs, extra_body=body)
        choices = [Choice([_id(t.token) for t in c.logprobs.content],
                          [t.logprob for t in c.logprobs.content],
                          [{_id(e.token): e.logprob for e in t.top_logprobs}
                           for t in c.logprobs.content],
                          c.message.content or "", c.finish_reason)
                   for c in sorted(reply.choices, key=lambda c: c.index)]
    else:
        prompt, logprobs = body.pop("prompt"), body.pop("logprobs")
        reply = api.completions.create(model=model, prompt=prompt, logprobs=logprobs,
                                       **native, extra_body=body)
        choices = [Choice([_id(t) for t in c.logprobs.tokens], list(c.logprobs.token_logprobs),
                          [top_k({_id(t): v for t, v in row.items()})
                           for row in c.logprobs.top_logprobs], c.text, c.finish_reason)
                   for c in sorted(reply.choices, key=lambda c: c.index)]
    return Answer(choices, reply.usage.prompt_tokens)


def top_k(entries: dict[int, float], k: int = TOP_LOGPROBS) -> dict[int, float]:
    """The k most likely (the served list may add the sampled token to its top k)."""
    return dict(sorted(entries.items(), key=lambda kv: -kv[1])[:k])


def send_streamed(api: openai.OpenAI, request: MatrixRequest, model: str = "tiny",
                  on_token=None) -> Answer:
    """One request, streamed: the choices put together from their chunks; `on_token(n)`
    is called with the number of tokens received so far after each chunk."""
    body = openai_body(request)
    native = {k: body.pop(k) for k in list(body) if k in _NATIVE}
    choices: dict[int, Choice] = {}
    usage = {"stream_options": {"include_usage": True}}
    if request.messages:
        kwargs = {k: body.pop(k) for k in ("messages", "logprobs", "top_logprobs", "tools",
                                           "tool_choice", "response_format") if k in body}
        stream = api.chat.completions.create(model=model, **native, **kwargs, stream=True,
                                             **usage, extra_body=body)
    else:
        prompt, logprobs = body.pop("prompt"), body.pop("logprobs")
        stream = api.completions.create(model=model, prompt=prompt, logprobs=logprobs,
                                        **native, stream=True, **usage, extra_body=body)
    prompt_tokens = None
    for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        for c in chunk.choices:
            into = choices.setdefault(c.index, Choice([], [], []))
            if request.messages:
                for t in (c.logprobs.content if c.logprobs and c.logprobs.content else []):
                    into.token_ids.append(_id(t.token))
                    into.logprobs.append(t.logprob)
                    into.top.append({_id(e.token): e.logprob for e in t.top_logprobs})
                into.text += c.delta.content or "" if c.delta else ""
            else:
                if c.logprobs is not None:
                    into.token_ids += [_id(t) for t in c.logprobs.tokens]
                    into.logprobs += list(c.logprobs.token_logprobs)
                    into.top += [top_k({_id(t): v for t, v in row.items()})
                                 for row in c.logprobs.top_logprobs]
                into.text += c.text
            into.finish_reason = c.finish_reason or into.finish_reason
        if on_token is not None:
            on_token(sum(len(c.token_ids) for c in choices.values()))
    return Answer([choices[i] for i in sorted(choices)], prompt_tokens)


def send_all(url: str, requests, concurrent: bool = False, model: str = "tiny",
             headers: dict[str, str] | None = None) -> dict[str, Answer]:
    """Every request's answer. In order by default (the second prefix request finds the
    first's blocks); `concurrent`: all at once (one thread each), the prefix pair still
    in order within its thread."""
    api = client(url, headers=headers)
    if not concurrent:
        return {r.name: send(api, r, model) for r in requests}
    groups: list[list[MatrixRequest]] = []
    for request in requests:
        if request.name == "prefix-second" and groups:
            groups[-1].append(request)  # right after prefix-first, same thread
        else:
            groups.append([request])
    with ThreadPoolExecutor(len(groups)) as pool:
        done = pool.map(lambda g: [(r.name, send(api, r, model)) for r in g], groups)
    return {name: answer for group in done for name, answer in group}
