"""`pagoda tokenizer`: the tokenizer service's process."""

from __future__ import annotations

import argparse
import logging

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.config import DEFAULT_PREFIX_HASH_SEED
from pagoda.engine.arg_utils import add_hub_args
from pagoda.services.common.grpc_server import add_server_args, serve_sync
from pagoda.services.common.logs import setup_logging

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
    parser.add_argument("--chat-template", default=None,
                        help="The chat template to use instead of the model's: a file, or the "
                             "template itself (vLLM's reading).")


def build_servicer(model: str | None, tokenizer_path: str | None = None,
                   prefix_hash_seed: str = DEFAULT_PREFIX_HASH_SEED,
                   chat_template: str | None = None, revision: str | None = None,
                   tokenizer_revision: str | None = None, download_dir: str | None = None):
    from pagoda.model.loader import load_arch_config, resolve_model_path
    from pagoda.services.tokenizer.servicer import TokenizerServicer
    from pagoda.tokenizer.chat_template import use_chat_template
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
    return TokenizerServicer(tokenizer, model_path, eos, prefix_hash_seed)


def main(args: argparse.Namespace) -> int:
    setup_logging("tokenizer")
    servicer = build_servicer(args.model, args.tokenizer, args.prefix_cache_hash_seed,
                              args.chat_template, args.revision, args.tokenizer_revision,
                              args.download_dir)
    serve_sync("tokenizer", args,
               [(pb_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE_NAME)],
               max_workers=16)
    return 0
