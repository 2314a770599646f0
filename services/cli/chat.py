"""`pagoda chat`: an interactive chat with a running server (like `vllm chat`).

Reads one user message per line (prompt `> `), sends the whole conversation to
`/v1/chat/completions`, streams the answer to stdout and keeps it in the
conversation. Ctrl-D (end of input) quits; `--quick MESSAGE` asks once and exits.
Server errors are printed to stderr; the session goes on. `pagoda complete`
shares the client set-up below.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TextIO

DEFAULT_URL = "http://localhost:8000/v1"


def add_client_args(parser: argparse.ArgumentParser) -> None:
    """The flags `pagoda chat` and `pagoda complete` share (vLLM's names)."""
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"The server's OpenAI base URL (default: {DEFAULT_URL}).")
    parser.add_argument("--api-key", default=None,
                        help="API key (default: $PAGODA_API_KEY, then $OPENAI_API_KEY).")
    parser.add_argument("--model-name", default=None,
                        help="Model to use (default: the first one /v1/models lists).")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="Most tokens per answer (default: the server's).")
    parser.add_argument("--temperature", type=float, default=None,
                        help="Sampling temperature (default: the server's).")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("chat", help="Chat with a running server, interactively.",
                                   description=__doc__.split("\n\n")[0])
    add_client_args(parser)
    parser.add_argument("--system-prompt", default=None, help="A system message to start with.")
    parser.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                        help="Send one message, print the answer and exit.")
    parser.set_defaults(func=run)
    return parser


def make_client(args: argparse.Namespace):
    """(openai client, model name); raises openai.APIError if the server cannot list
    its models (unreachable, wrong key)."""
    # lazy: openai is optional and takes ~2 s to import; the CLI imports this module for its flags
    import openai

    api_key = (args.api_key or os.environ.get("PAGODA_API_KEY")
               or os.environ.get("OPENAI_API_KEY") or "EMPTY")
    client = openai.OpenAI(base_url=args.url, api_key=api_key, max_retries=0)
    model = args.model_name or client.models.list().data[0].id
    return client, model


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {k: v for k, v in (("max_tokens", args.max_tokens),
                              ("temperature", args.temperature)) if v is not None}


def input_lines(prompt: str = "> ") -> Iterator[str]:
    """Lines typed at the prompt, until end of input (Ctrl-D) or Ctrl-C."""
    while True:
        try:
            yield input(prompt)
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return


def chat_turn(client, model: str, conversation: list[dict], extra: dict, out: TextIO) -> str:
    """Stream one answer to `out`; return its text."""
    parts = []
    stream = client.chat.completions.create(model=model, messages=conversation, stream=True,
                                            **extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
            out.write(parts[-1])
            out.flush()
    out.write("\n")
    return "".join(parts)


def chat_loop(client, model: str, args: argparse.Namespace, lines: Iterable[str],
              out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The conversation: one turn per line. Returns the exit code."""
    # lazy: openai is optional and takes ~2 s to import; the CLI imports this module for its flags
    import openai

    conversation: list[dict] = []
    if args.system_prompt:
        conversation.append({"role": "system", "content": args.system_prompt})
    for line in lines:
        conversation.append({"role": "user", "content": line})
        try:
            answer = chat_turn(client, model, conversation, sampling_kwargs(args), out)
        except openai.APIError as exc:
            conversation.pop()  # the server did not answer it: forget the message
            err.write(f"error: {exc}\n")
            if args.quick is not None:
                return 1
            continue
        conversation.append({"role": "assistant", "content": answer})
    return 0


def run_client(args: argparse.Namespace, loop, what: str) -> int:
    """Connect, then run `loop(client, model, args, lines)` on `--quick` or stdin.

    Shared by `pagoda chat` and `pagoda complete`; `what` names one line of input.
    """
    # lazy: openai is optional and takes ~2 s to import; the CLI imports this module for its flags
    import openai

    try:
        client, model = make_client(args)
    except openai.APIError as exc:
        print(f"error: {args.url} did not list its models: {exc}", file=sys.stderr)
        return 1
    if args.quick is not None:
        return loop(client, model, args, [args.quick])
    print(f"Using model: {model}. Type {what}; Ctrl-D quits.", file=sys.stderr)
    return loop(client, model, args, input_lines())


def run(args: argparse.Namespace) -> int:
    return run_client(args, chat_loop, "a message")
