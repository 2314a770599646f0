"""`pagoda tokenizer`: the tokenizer service's process."""

from __future__ import annotations

import argparse
import logging

from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from pagoda.config import DEFAULT_PREFIX_HASH_SEED
from pagoda.services.common.grpc_server import add_server_args, serve_sync
from pagoda.services.common.logs import setup_logging

DEFAULT_PORT = 50051
SERVICE_NAME = "pagoda.tokenizer.v1.TokenizerService"
logger = logging.getLogger(__name__)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_server_args(parser, DEFAULT_PORT)
    parser.add_argument("--model", default=None,
                        help="HF safetensors directory or GGUF file (default: SmolLM2-135M-Instruct).")
    parser.add_argument("--tokenizer", default=None, help="Tokenizer path (default: the model's).")
    parser.add_argument("--prefix-cache-hash-seed", default=DEFAULT_PREFIX_HASH_SEED,
                        help="Seed of the prefix-cache block hashes Tokenize returns; must equal "
                             "the schedulers'.")
    parser.add_argument("--chat-template", default=None,
                        help="The chat template to use instead of the model's: a file, or the "
                             "template itself (vLLM's reading).")


def build_servicer(model: str | None, tokenizer_path: str | None = None,
                   prefix_hash_seed: str = DEFAULT_PREFIX_HASH_SEED,
                   chat_template: str | None = None):
    from pagoda.model.loader import load_arch_config, resolve_model_path
    from pagoda.services.tokenizer.servicer import TokenizerServicer
    from pagoda.tokenizer.chat_template import use_chat_template
    from pagoda.tokenizer.loader import load_tokenizer

    model_path = resolve_model_path(model)
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
                              args.chat_template)
    serve_sync("tokenizer", args,
               [(pb_grpc.add_TokenizerServiceServicer_to_server, servicer, SERVICE_NAME)],
               max_workers=16)
    return 0
