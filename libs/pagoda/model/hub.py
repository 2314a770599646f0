"""Hugging Face model ids: download what serving needs from the hub into the HF cache.

Every place that takes a model or tokenizer (`LLM(model=...)`, `pagoda serve`, the
scheduler, gpu-worker and tokenizer services, `pagoda download`) resolves it through
`resolve_model_path`/`resolve_tokenizer_path`, which call `download` here for an id that
is not a local path. Invariants:

  * Only what serving reads is fetched: `config.json`, `generation_config.json`, the
    tokenizer files and, for a model, its weight files as `pagoda.model.weight_files`
    chooses them (safetensors and their index; `*.bin`/`*.pt` only when the repo has no
    safetensors). A `.bin` beside safetensors is never downloaded.
  * Files land in the HF cache (`--download-dir`, else `$HF_HUB_CACHE`, else
    `$HF_HOME/hub`), in huggingface_hub's layout, so other HF tools share them; the
    returned path is the snapshot folder of the resolved commit.
  * `HF_HUB_OFFLINE=1`: no request leaves the process; the cache answers or the error
    says what to download.
  * `HF_TOKEN` is sent as a bearer token to the hub (never to the CDN the hub redirects
    large files to); it is read from the environment only, never from a command line.
  * Errors name the model id: not found, gated (needs a token / access), unknown
    revision, offline and not cached.

The environment is read at call time, not when huggingface_hub is imported, so one
process can be pointed at another endpoint, cache or offline mode (tests do).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
from typing import Literal

from pagoda.model.weight_files import read_index, select_weight_files

logger = logging.getLogger(__name__)

Kind = Literal["model", "tokenizer"]
DEFAULT_REVISION = "main"
DEFAULT_ENDPOINT = "https://huggingface.co"
# Root-level files besides the weights; fnmatch patterns.
CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                   "merges.txt", "chat_template*", "*.tiktoken", "spiece.model")
# A sentence-transformers model's pooling setup (`pagoda.model.pooler_config`): its module
# list and configs at the root, and each module folder's config (`1_Pooling/config.json`).
POOLING_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json")
# A multi-modal model's HF processor settings (pagoda.multimodal.processing): the image
# processor's resize/normalize config, read where prompts are processed.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# ORG/NAME as the hub spells repo ids (letters, digits, "-", "_", "."; no "--" or "..").
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")


class ModelNotFoundError(FileNotFoundError):
    """Neither a local path nor a repository the hub shows us (or not in the offline cache)."""


class GatedModelError(PermissionError):
    """The repository exists but this token (or no token) may not read its files."""


def is_hub_id(model: str) -> bool:
    """True for `ORG/NAME` that is not an existing local path (vLLM's reading)."""
    if os.path.exists(os.path.expanduser(model)):
        return False
    return bool(_REPO_ID.fullmatch(model)) and "--" not in model and ".." not in model


def hub_cache_dir(download_dir: str | None = None) -> str:
    """Where downloads go: `download_dir`, else huggingface_hub's own default, read now."""
    if download_dir:
        return os.path.abspath(os.path.expanduser(download_dir))
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def is_offline() -> bool:
    """huggingface_hub's reading of HF_HUB_OFFLINE (and transformers' TRANSFORMERS_OFFLINE)."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def download(repo_id: str, revision: str | None = None, download_dir: str | None = None,
             kind: Kind = "model") -> str:
    """Fetch (or find in the cache) what serving `repo_id` needs; return its snapshot folder.

    `kind="tokenizer"`: only the config, generation config and tokenizer files (the
    tokenizer service needs no weights). Raises ModelNotFoundError, GatedModelError or
    ValueError (unknown revision, no weights in the repo), each naming `repo_id`.
    """
    # lazy: huggingface_hub and its HTTP client load only for a model from the Hub (a
    # local path never needs them).
    import httpx2  # huggingface_hub's HTTP client
    from huggingface_hub import errors

    revision = revision or DEFAULT_REVISION
    cache_dir = hub_cache_dir(download_dir)
    where = f"{repo_id!r} (revision {revision!r})"
    try:
        if is_offline():
            return _from_cache(repo_id, revision, cache_dir, kind, where)
        try:
            return _from_hub(repo_id, revision, cache_dir, kind)
        except (httpx2.TransportError, errors.OfflineModeIsEnabled) as exc:
            # The hub cannot be reached: what the cache holds still serves (as in
            # huggingface_hub's own snapshot_download).
            logger.warning("the Hugging Face hub at %s cannot be reached (%s); looking for %s "
                           "in the cache %s", _endpoint(), exc, where, cache_dir)
            try:
                return _from_cache(repo_id, revision, cache_dir, kind, where)
            except ModelNotFoundError:
                raise ModelNotFoundError(
                    f"Cannot get model {where}: it is not a local path, the Hugging Face hub "
                    f"at {_endpoint()} cannot be reached ({exc}), and the cache {cache_dir} "
                    "does not hold it") from exc
    except errors.GatedRepoError as exc:
        raise GatedModelError(_gated_message(repo_id)) from exc
    except errors.RepositoryNotFoundError as exc:
        raise ModelNotFoundError(
            f"Model {repo_id!r} is not a local path, and the Hugging Face hub at "
            f"{_endpoint()} has no model repository {repo_id!r} (a private repository "
            "also reads as missing without a token: set HF_TOKEN)") from exc
    except errors.RevisionNotFoundError as exc:
        raise ValueError(f"Model {repo_id!r} has no revision {revision!r} on the Hugging "
                         f"Face hub at {_endpoint()} (--revision: a branch, tag or commit)"
                         ) from exc
    except errors.LocalEntryNotFoundError as exc:  # includes an incomplete cached snapshot
        cause = exc.__cause__
        if isinstance(cause, errors.HfHubHTTPError) and _status(cause) in (401, 403):
            raise GatedModelError(_gated_message(repo_id)) from exc
        raise ModelNotFoundError(
            f"Cannot get model {where}: the Hugging Face hub at {_endpoint()} could not be "
            f"reached and the cache {cache_dir} does not hold it ({exc})") from exc
    except errors.HfHubHTTPError as exc:
        if _status(exc) in (401, 403):
            raise GatedModelError(_gated_message(repo_id)) from exc
        raise


def _from_hub(repo_id: str, revision: str, cache_dir: str, kind: Kind) -> str:
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download  # lazy: Hub only

    endpoint, token = _endpoint(), os.environ.get("HF_TOKEN") or None
    info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision)
    names = [s.rfilename for s in info.siblings or []]

    def fetch_index(name: str) -> list[str]:
        return read_index(hf_hub_download(repo_id, name, revision=info.sha, cache_dir=cache_dir,
                                          endpoint=endpoint, token=token))

    files = _files_to_fetch(repo_id, names, kind, fetch_index)
    logger.info("downloading %s (revision %s, commit %s) into %s: %s", repo_id, revision,
                info.sha, cache_dir, ", ".join(files))
    # snapshot_download (not one hf_hub_download per file): it records the revision's
    # commit in the cache (refs/), which offline mode later resolves the revision with.
    return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                             allow_patterns=files, endpoint=endpoint, token=token)


def _from_cache(repo_id: str, revision: str, cache_dir: str, kind: Kind, where: str) -> str:
    """HF_HUB_OFFLINE: the same files from the cache, chosen from the cached file listing."""
    # lazy: huggingface_hub loads only for a model from the Hub.
    from huggingface_hub import get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        names = [f.path for f in get_cached_repo_tree(repo_id, revision=revision,
                                                       cache_dir=cache_dir)]
    except CachedRepoTreeNotFoundError:
        names = None  # cached by a tool that keeps no listing: take the snapshot as it is
    try:
        # Finds the revision's snapshot folder; with a listing, checks only config.json is
        # there (the listing names files we never fetch, e.g. a .bin beside safetensors).
        snapshot = snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                     local_files_only=True,
                                     allow_patterns=None if names is None else ["config.json"])
        if names is None:
            return snapshot
        files = _files_to_fetch(repo_id, names, kind,
                                lambda index: read_index(os.path.join(snapshot, index)))
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=files, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError) as exc:
        raise ModelNotFoundError(
            f"HF_HUB_OFFLINE is set and model {where} is not (completely) in the cache "
            f"{cache_dir}: run `pagoda download {repo_id}` with access to the hub first, "
            "or unset HF_HUB_OFFLINE") from exc


def _files_to_fetch(repo_id: str, names: list[str], kind: Kind, fetch_index) -> list[str]:
    """The repo files serving reads: config and tokenizer files, and the weights."""
    root = [n for n in names if "/" not in n]
    wanted = [n for n in root if any(fnmatch.fnmatchcase(n, p)
                                     for p in (*CONFIG_FILES, *TOKENIZER_FILES, *POOLING_FILES,
                                               *PROCESSOR_FILES))]
    if "modules.json" in root:
        wanted += [n for n in names if n.count("/") == 1 and n.endswith("/config.json")]
    if "config.json" not in root:
        raise ValueError(f"Model {repo_id!r} on the Hugging Face hub has no config.json; "
                         "Pagoda serves transformers-format checkpoints (or a local GGUF file)")
    if kind == "tokenizer":
        return wanted
    weights = select_weight_files(root, fetch_index)
    if weights is None:
        ggufs = [n for n in root if n.endswith(".gguf")]
        hint = (f"; it holds GGUF files ({', '.join(ggufs[:4])}): download one and pass its "
                "path" if ggufs else "")
        raise ValueError(f"Model {repo_id!r} on the Hugging Face hub has no *.safetensors, "
                         f"*.bin or *.pt weights{hint}")
    return wanted + weights.names()


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _status(exc) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _gated_message(repo_id: str) -> str:
    if os.environ.get("HF_TOKEN"):
        why = ("the token in HF_TOKEN has no access to it: accept its terms on the model's "
               "hub page with that account, or use a token that has access")
    else:
        why = "set HF_TOKEN to a Hugging Face token that has access to it"
    return f"Model {repo_id!r} is gated or private on the Hugging Face hub at {_endpoint()}: {why}"
