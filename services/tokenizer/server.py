"""`pagoda tokenizer`: the tokenizer service's process."""

from __future__ import annotations

import argparse
import logging

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.config import DEFAULT_PREFIX_HASH_SEED
from pagoda.core.block_hash import DEFAULT_HASH_ALGO
from pagoda.engine.arg_utils import add_hub_args
from pagoda.services.common import startup_clock
from pagoda.services.common.grpc_server import add_server_args, serve_sync
from pagoda.services.common.logs import setup_logging
from pagoda.services.tokenizer.servicer import TokenizerServicer
from pagoda.tokenizer.chat_template import use_chat_template
from pagoda.tokenizer.template_sandbox import MAX_OUTPUT_CHARS, MAX_RENDER_SECONDS, TemplateLimits

DEFAULT_PORT = 50051
SERVICE_NAME = "pagoda.tokenizer.v1.TokenizerService"
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument("--model", default=None,
                        help="HF safetensors directory, GGUF file or Hugging Face model id "
                             "(default: SmolLM2-135M-Instruct).")
    add_hub_args(parser)  # --tokenizer, --revision, --tokenizer-revision, --download-dir
    parser.add_argument("--prefix-cache-hash-seed", default=DEFAULT_PREFIX_HASH_SEED,
                        help="Seed of the prefix-cache block hashes Tokenize returns; must equal "
                             "the schedulers'.")
    parser.add_argument("--prefix-caching-hash-algo", default=DEFAULT_HASH_ALGO,
                        help="Algorithm of those hashes (pagoda, or vLLM's sha256 / "
                             "sha256_cbor); must equal the schedulers'.")
    parser.add_argument("--chat-template", default=None,
                        help="The chat template to use instead of the model's: a file, or the "
                             "template itself (vLLM's reading).")
    add_template_limit_args(parser)


def add_template_limit_args(parser: argparse.ArgumentParser) -> None:
    """The chat-template sandbox's limits (pagoda.tokenizer.template_sandbox)."""
    parser.add_argument("--chat-template-render-timeout", type=float, default=MAX_RENDER_SECONDS,
                        metavar="SECONDS",
                        help="A chat template that renders longer is stopped and its request "
                             "refused (400).")
    parser.add_argument("--chat-template-max-output-chars", type=int, default=MAX_OUTPUT_CHARS,
                        metavar="N",
                        help="Largest text a chat template may build (a list counts 8 per "
                             "item, plus what it holds); a render that would build more is "
                             "refused before it builds it (400).")


def template_limit_flags(args: argparse.Namespace) -> list[str]:
    """The limit flags set to other than their defaults, for a tokenizer child process."""
    limits, default = template_limits_from_args(args), TemplateLimits()
    flags = []
    if limits.render_timeout_s != default.render_timeout_s:
        flags += ["--chat-template-render-timeout", f"{limits.render_timeout_s:g}"]
    if limits.max_output_chars != default.max_output_chars:
        flags += ["--chat-template-max-output-chars", str(limits.max_output_chars)]
    return flags


def template_limits_from_args(args: argparse.Namespace):
    try:
        return TemplateLimits(args.chat_template_render_timeout,
                              args.chat_template_max_output_chars)
    except ValueError as exc:
        raise SystemExit(f"--chat-template-render-timeout/--chat-template-max-output-chars: "
                         f"{exc}") from None


def build_servicer(model: str | None, tokenizer_path: str | None = None,
                   prefix_hash_seed: str = DEFAULT_PREFIX_HASH_SEED,
                   chat_template: str | None = None, revision: str | None = None,
                   tokenizer_revision: str | None = None, download_dir: str | None = None,
                   prefix_caching_hash_algo: str = DEFAULT_HASH_ALGO):
    # lazy: the model and tokenizer loaders bring torch and transformers; the CLI imports this
    # module for its flags
    from pagoda.model.loader import load_arch_config, resolve_model_path
    from pagoda.tokenizer.loader import load_tokenizer, resolve_tokenizer_path

    # A hub id: only its config and tokenizer files, never the weights.
    model_path = resolve_model_path(model, revision, download_dir, weights=False)
    if tokenizer_path:
        tokenizer_path = resolve_tokenizer_path(tokenizer_path, tokenizer_revision or revision,
                                                download_dir)
    tokenizer = load_tokenizer(tokenizer_path or model_path)
    use_chat_template(tokenizer, chat_template)
    eos = load_arch_config(model_path).eos_token_ids
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    logger.info("tokenizer of %s loaded (vocab %d)", model_path, len(tokenizer))
    return TokenizerServicer(tokenizer, model_path, eos, prefix_hash_seed, prefix_caching_hash_algo)


def main(args: argparse.Namespace) -> int:
    setup_logging("tokenizer")
    startup_clock.mark("imports")
    limits = template_limits_from_args(args)
    servicer = build_servicer(args.model, args.tokenizer, args.prefix_cache_hash_seed,
                              args.chat_template, args.revision, args.tokenizer_revision,
                              args.download_dir, args.prefix_caching_hash_algo)
    servicer.template_limits = limits
    startup_clock.mark("tokenizer load")
    serve_sync("tokenizer", args,
               [(pb_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE_NAME)],
               max_workers=16)
    return 0
