"""`pagoda complete`: complete prompts against a running server (like `vllm complete`).

Reads one prompt per line (prompt `> `), streams its completion from
`/v1/completions` to stdout. Ctrl-D quits; `--quick PROMPT` completes once and
exits. Server errors are printed to stderr; the session goes on.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import TextIO

from pagoda.services.cli.chat import add_client_args, run_client, sampling_kwargs


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("complete", help="Complete prompts with a running server.",
                                   description=__doc__.split("\n\n")[0])
    add_client_args(parser)
    parser.add_argument("-q", "--quick", metavar="PROMPT", default=None,
                        help="Complete one prompt, print the text and exit.")
    parser.set_defaults(func=run)
    return parser


def complete_loop(client, model: str, args: argparse.Namespace, lines: Iterable[str],
                  out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    # lazy: openai is optional and takes ~2 s to import; the CLI imports this module for its flags
    import openai

    for line in lines:
        try:
            stream = client.completions.create(model=model, prompt=line, stream=True,
                                               **sampling_kwargs(args))
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    out.write(chunk.choices[0].text)
                    out.flush()
            out.write("\n")
        except openai.APIError as exc:
            err.write(f"error: {exc}\n")
            if args.quick is not None:
                return 1
    return 0


def run(args: argparse.Namespace) -> int:
    return run_client(args, complete_loop, "a prompt")
