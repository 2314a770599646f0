"""`pagoda download MODEL`: fetch a Hugging Face model into the cache, print where it is.

The files are those serving reads (`pagoda.model.hub`): config, generation config,
tokenizer files and the weights (safetensors; `*.bin` only without them), or with
`--tokenizer-only` no weights. The Helm chart runs it as an init container, so a pod's
containers then start with HF_HUB_OFFLINE=1 and read the cache: one download per pod,
not one per container. `pagoda serve` does the same before it starts its services
(`prefetch_for_serve`). The token comes from $HF_TOKEN only, never from the command line.
"""

from __future__ import annotations

import argparse
import sys

from pagoda.engine.arg_utils import add_hub_args
from pagoda.model.hub import download, is_hub_id

# Why the services started after a download get it: they must not fetch again, nor race
# each other writing the same cache files.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "download", help="Download a Hugging Face model into the cache (HF_HOME).",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("model", metavar="MODEL", help="Hugging Face model id, ORG/NAME.")
    add_hub_args(parser)
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="Only the config and tokenizer files (what the tokenizer "
                             "service reads), no weights.")
    parser.set_defaults(func=run)
    return parser


def fetch(model: str | None, revision: str | None = None, tokenizer: str | None = None,
          tokenizer_revision: str | None = None, download_dir: str | None = None,
          tokenizer_only: bool = False) -> list[str]:
    """Download (or find in the cache) the hub ids among `model` and `tokenizer`; return the
    local paths fetched. Local paths and None are left alone."""
    paths = []
    if model and is_hub_id(model):
        paths.append(download(model, revision, download_dir,
                              "tokenizer" if tokenizer_only else "model"))
    if tokenizer and is_hub_id(tokenizer):
        paths.append(download(tokenizer, tokenizer_revision or revision, download_dir,
                              "tokenizer"))
    return paths


def prefetch_for_serve(args: argparse.Namespace) -> dict[str, str]:
    """`pagoda serve`: download once, before any service starts; the environment the
    services must then run with (offline once something was fetched, else nothing)."""
    fetched = fetch(args.model_tag or args.model, args.revision, args.tokenizer,
                    args.tokenizer_revision, args.download_dir)
    return dict(OFFLINE_ENV) if fetched else {}


def hub_flags(args: argparse.Namespace) -> list[str]:
    """The hub flags the user set, re-rendered for the tokenizer service."""
    flags = []
    for name in ("revision", "tokenizer_revision", "download_dir"):
        value = getattr(args, name, None)
        if value:
            flags += ["--" + name.replace("_", "-"), value]
    return flags


def run(args: argparse.Namespace) -> int:
    if not is_hub_id(args.model):
        print(f"pagoda download: error: {args.model!r} is not a Hugging Face model id "
              "(ORG/NAME) or is a local path already", file=sys.stderr)
        return 2
    try:
        paths = fetch(args.model, args.revision, args.tokenizer, args.tokenizer_revision,
                      args.download_dir, args.tokenizer_only)
    except (OSError, ValueError) as exc:
        print(f"pagoda download: error: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(path, flush=True)
    return 0
