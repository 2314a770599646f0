"""`pagoda tokenizer`: the tokenizer service's process."""

from __future__ import annotations

import argparse
import logging
import os

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.config import DEFAULT_PREFIX_HASH_SEED
from pagoda.core.block_hash import DEFAULT_HASH_ALGO
from pagoda.engine.arg_utils import add_hub_args
from pagoda.engine.multimodal_args import add_multimodal_cli_args
from pagoda.json_flag import json_object
from pagoda.services.common import startup_clock
from pagoda.services.common.gc_tuning import prepare_gc_for_serving
from pagoda.services.common.grpc_server import add_server_args, serve_sync
from pagoda.services.common.logs import setup_logging
from pagoda.services.tokenizer.servicer import TokenizerServicer
from pagoda.tokenizer import harmony
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
    add_media_args(parser)


def add_media_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's multi-modal flags; the tokenizer service is the cluster's processor (it
    fetches media and runs the model's HF processor). See pagoda.multimodal.media for
    what the allow-lists refuse (SSRF)."""
    group = parser.add_argument_group("multi-modal inputs (vLLM's flags)")
    group.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="Only these hosts may be fetched for http(s) image URLs (a "
                            "listed host may be private). Unset: any host whose addresses "
                            "are all public; loopback, private and link-local are refused.")
    group.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                       help="file:// image URLs are read only under this directory (unset: "
                            "refused). A security risk: only in trusted environments.")
    add_multimodal_cli_args(parser)  # --limit-mm-per-prompt, --mm-processor-kwargs, cache


def media_flags(args: argparse.Namespace) -> list[str]:
    """The media flags set, for a tokenizer child process."""
    flags = []
    if args.allowed_media_domains:
        flags += ["--allowed-media-domains", *args.allowed_media_domains]
    if args.allowed_local_media_path:
        flags += ["--allowed-local-media-path", args.allowed_local_media_path]
    if args.limit_mm_per_prompt:
        flags += ["--limit-mm-per-prompt", args.limit_mm_per_prompt]
    if args.mm_processor_kwargs:
        flags += ["--mm-processor-kwargs", args.mm_processor_kwargs]
    flags += ["--mm-processor-cache-gb", f"{args.mm_processor_cache_gb:g}"]
    return flags


def build_media(servicer, args: argparse.Namespace) -> None:
    """Attach the cluster's processor (None for a text-only model: media are refused)."""
    # lazy: the processor and media loaders bring PIL and transformers' image processors
    from pagoda.model.model_path import load_arch_config
    from pagoda.multimodal.media import MediaLimits
    from pagoda.multimodal.processing import load_mm_processor, parse_limit_mm_per_prompt
    from pagoda.services.tokenizer.media_prompt import MediaPreprocessor

    try:
        limit = parse_limit_mm_per_prompt(args.limit_mm_per_prompt)
    except ValueError as exc:
        raise SystemExit(f"--limit-mm-per-prompt: {exc}") from None
    processor = None
    if os.path.isdir(servicer.model):
        processor = load_mm_processor(servicer.model, servicer.tokenizer)
    # A text-only model's architecture only names it when media are refused: looked up
    # then (MediaPreprocessor.architecture), not at every start.
    architecture = processor.architecture if processor is not None else \
        (lambda: load_arch_config(servicer.model).architecture)
    limits = MediaLimits.from_flags(args.allowed_media_domains, args.allowed_local_media_path)
    servicer.media = MediaPreprocessor(processor, architecture, servicer.model, limits, limit,
                                       args.mm_processor_cache_gb,
                                       json_object(args.mm_processor_kwargs,
                                                   "--mm-processor-kwargs") or {})
    if processor is not None:
        logger.info("multi-modal processor of %s loaded (%s)", servicer.model, architecture)


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
    # lazy: the tokenizer loader brings transformers; the CLI imports this module for its
    # flags. Neither brings torch for a GGUF (seconds of CPU per replica at a start).
    from pagoda.model.model_path import config_architecture, eos_token_ids, resolve_model_path
    from pagoda.tokenizer.loader import load_tokenizer, resolve_tokenizer_path

    # A hub id: only its config and tokenizer files, never the weights.
    model_path = resolve_model_path(model, revision, download_dir, weights=False)
    if tokenizer_path:
        tokenizer_path = resolve_tokenizer_path(tokenizer_path, tokenizer_revision or revision,
                                                download_dir)
    tokenizer = load_tokenizer(tokenizer_path or model_path)
    use_chat_template(tokenizer, chat_template)
    eos = eos_token_ids(model_path)
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    logger.info("tokenizer of %s loaded (vocab %d)", model_path, len(tokenizer))
    servicer = TokenizerServicer(tokenizer, model_path, eos, prefix_hash_seed,
                                 prefix_caching_hash_algo)
    servicer.harmony = use_harmony(config_architecture(model_path), tokenizer, chat_template)
    servicer.tokenizer_path = os.path.abspath(tokenizer_path or model_path)
    return servicer


def use_harmony(architecture: str | None, tokenizer, chat_template: str | None) -> bool:
    """Whether chats render in the harmony format (gpt-oss, as vLLM does: its chat
    template, and --chat-template, are not used). A tokenizer without the harmony
    control tokens still serves completions; its chats are refused (400) naming them."""
    if not harmony.uses_harmony(architecture):
        return False
    try:
        harmony.encode_harmony(tokenizer, [harmony.Control(t) for t in harmony.CONTROL_TOKENS])
    except ValueError as exc:
        logger.warning("%s: %s Chat requests will be refused.", architecture, exc)
    if chat_template is not None:
        logger.warning("%s chats are rendered in the harmony format, as vLLM renders them; "
                       "--chat-template is not used for them.", architecture)
    logger.info("%s: chats are rendered in the harmony format", architecture)
    return True


def main(args: argparse.Namespace) -> int:
    setup_logging("tokenizer")
    startup_clock.mark("imports")
    limits = template_limits_from_args(args)
    servicer = build_servicer(args.model, args.tokenizer, args.prefix_cache_hash_seed,
                              args.chat_template, args.revision, args.tokenizer_revision,
                              args.download_dir, args.prefix_caching_hash_algo)
    servicer.template_limits = limits
    build_media(servicer, args)
    startup_clock.mark("tokenizer load")
    prepare_gc_for_serving()  # the tokenizer, its vocabulary, the chat templates: frozen
    serve_sync("tokenizer", args,
               [(pb_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE_NAME)],
               max_workers=16)
    return 0
