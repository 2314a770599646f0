"""`pagoda run-batch -i requests.jsonl -o results.jsonl`: an OpenAI batch file, offline.

The file format is OpenAI's (and `vllm run-batch`'s); batch_requests.py has the line
formats. Invariants:
  * one output line per input line (blank lines are not requests), in input order;
    a line that cannot run gets an error line in its place and the rest run on;
  * every runnable request of the file goes to the offline engine at once, so the
    engine batches them as it would concurrent requests to a server;
  * an output line is written (and flushed) as soon as it and every line before it
    are finished, so an interrupted run keeps what it finished: `--skip-done` then
    appends only the lines whose custom_id the output file does not have yet
    (a torn last line is cut off first);
  * `-` reads stdin / writes stdout; the progress bar and logs go to stderr.
It takes the model and engine flags of `pagoda serve` (EngineArgs), `--served-model-name`,
`--chat-template` and the generation-config flags, with the same meaning. A pooling
model (`--runner pooling`, or auto-detected) answers /v1/embeddings lines, a generation
model chat and completions lines; a line for the other kind gets a 400 error line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Any

from tqdm.auto import tqdm

from pagoda.engine.arg_utils import EngineArgs
from pagoda.generation_config import parse_override
from pagoda.services.cli.batch_requests import (EngineContext, output_line, parse_line, prepare,
                                                response_body)
from pagoda.services.common.logs import setup_logging
from pagoda.services.gateway.errors import APIError
from pagoda.services.gateway.serving_options import ServingOptions
from pagoda.tokenizer.chat_template import use_chat_template
from pagoda.tokenizer.harmony import uses_harmony

INPUT_HELP = "The batch file: one JSON request per line (a local file, or - for stdin)."


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "run-batch", help="Run an OpenAI batch file (JSONL) through the offline engine.",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("-i", "--input-file", required=True, help=INPUT_HELP)
    parser.add_argument("-o", "--output-file", required=True,
                        help="Where results go, one JSON line per request (a local file, or "
                             "- for stdout).")
    parser.add_argument("--skip-done", action="store_true",
                        help="Resume: keep the output file, skip the custom_ids it already "
                             "has and append the rest.")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="Names a request's `model` may use (default: the model argument).")
    parser.add_argument("--chat-template", default=None,
                        help="Chat template instead of the model's: a file or the template.")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="Report prompt_tokens_details.cached_tokens in usage.")
    EngineArgs.add_cli_args(parser.add_argument_group("engine (as for pagoda serve)"))
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    setup_logging("run-batch")
    if args.skip_done and args.output_file == "-":
        return _fail("--skip-done needs an output file to resume, not stdout")
    try:
        lines = _read_input(args.input_file)
        done = _done_custom_ids(args.output_file) if args.skip_done else set()
    except OSError as exc:
        return _fail(f"{exc.filename}: {exc.strerror}")
    try:
        engine, ctx = _start_engine(args)
    except (ValueError, FileNotFoundError) as exc:
        return _fail(str(exc))
    mode = "a" if args.skip_done else "w"
    out = sys.stdout if args.output_file == "-" else open(args.output_file, mode,
                                                          encoding="utf-8")
    try:
        run_lines(engine, ctx, lines, done, out)
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def run_lines(engine: Any, ctx: Any, lines: list[tuple[int, str]], done: set[str],
              out: IO[str]) -> None:
    """Run `lines` ((line number, text)) through `engine`, writing one line each to `out`."""
    items, seen = [], set(done)
    for line_no, text in lines:
        item = parse_line(line_no, text)
        if item.error is None and item.custom_id in done:
            continue
        if item.error is None and item.custom_id in seen:
            item.error = APIError(f"duplicate custom_id {item.custom_id!r}", param="custom_id")
        seen.add(item.custom_id)
        if item.error is None:
            prepare(item, ctx)
        items.append(item)
    writer = _InOrderWriter(out, len(items))
    pending = _submit(engine, items)
    running = {index for index, _ in pending.values()}
    with tqdm(total=len(items), desc="Running batch", unit="req", file=sys.stderr) as bar:
        for index, item in enumerate(items):
            if index not in running:
                writer.put(index, output_line(item))
                bar.update(1)
        outputs: dict[int, dict[int, Any]] = {i: {} for i in running}
        while engine.has_unfinished_requests():
            for output in engine.step():
                index, prompt_index = pending[output.request_id]
                outputs[index][prompt_index] = output
                item = items[index]
                if len(outputs[index]) == len(item.prompts):
                    writer.put(index, _finished_line(item, outputs.pop(index), ctx))
                    bar.update(1)


def _submit(engine: Any, items: list) -> dict[str, tuple[int, int]]:
    """Add every prepared prompt to the engine: {engine request id: (item, prompt)}.
    An item the engine refuses gets its error, and its other prompts are withdrawn."""
    pending: dict[str, tuple[int, int]] = {}
    for index, item in enumerate(items):
        if item.error is not None:
            continue
        ids = []
        try:
            for p, prompt in enumerate(item.prompts):
                ids.append(engine.add_request(prompt.text, prompt.token_ids, prompt.params,
                                              request_id=f"batch-{index}-{p}",
                                              priority=prompt.priority))
        except ValueError as exc:
            engine.abort_request(ids)
            item.error = APIError(str(exc))
            continue
        pending.update({rid: (index, p) for p, rid in enumerate(ids)})
    return pending


def _finished_line(item: Any, outputs: dict[int, Any], ctx: Any) -> dict:
    return output_line(item, response_body(item, [outputs[p] for p in sorted(outputs)], ctx))


class _InOrderWriter:
    """Writes line i once lines 0..i-1 are written (results may finish out of order)."""

    def __init__(self, out: IO[str], total: int) -> None:
        self.out, self.total = out, total
        self._next = 0
        self._ready: dict[int, dict] = {}

    def put(self, index: int, line: dict) -> None:
        self._ready[index] = line
        while self._next in self._ready:
            self.out.write(json.dumps(self._ready.pop(self._next), ensure_ascii=False) + "\n")
            self._next += 1
        self.out.flush()


def _start_engine(args: argparse.Namespace):
    # lazy: the engine brings torch; the CLI imports this module for its flags
    from pagoda.engine.llm_engine import LLMEngine

    options = ServingOptions(args.max_logprobs, args.generation_config,
                             parse_override(args.override_generation_config),
                             args.enable_prompt_tokens_details)
    template = args.chat_template
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    use_chat_template(engine.tokenizer, template)
    config = engine.config
    options.generation_defaults(config.model)  # a bad generation config fails before the run
    pooling_task = config.pooler_config.task if config.runner == "pooling" else None
    return engine, EngineContext(engine.tokenizer, config.served_model_name, config.model,
                                 config.scheduler.max_model_len, options, pooling_task,
                                 harmony=uses_harmony(config.arch.architecture))


def _read_input(path: str) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line."""
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
    try:
        return [(n, line) for n, line in enumerate(stream, start=1) if line.strip()]
    finally:
        if stream is not sys.stdin:
            stream.close()


def _done_custom_ids(path: str) -> set[str]:
    """The custom_ids an earlier run wrote to `path`; a torn last line (the run was
    killed mid-write) is cut off so that appending starts on a fresh line."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
            data = data[:data.rfind(b"\n") + 1]
    done = set()
    for raw in data.splitlines():
        try:
            custom_id = json.loads(raw).get("custom_id")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(custom_id, str):
            done.add(custom_id)
    return done


def _fail(message: str) -> int:
    print(f"pagoda run-batch: error: {message}", file=sys.stderr, flush=True)
    return 2
