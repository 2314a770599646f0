"""Which runner a model gets, and its `PoolerConfig` (vLLM's `--runner`, `--pooler-config`).

`--runner auto` (the default) serves a model as a pooling model when its architecture
only pools (an encoder: `BertModel`, `XLMRobertaModel`, `BertForSequenceClassification`;
a bare decoder checkpoint: `MistralModel`, `Qwen2Model`, ...) or its folder is
a sentence-transformers model (`modules.json`); every other model generates. `--runner
pooling` also turns a generative decoder into an embedding model (last-token pooling,
`pooling_model.as_pooling_model`).

The pooler's settings come, first to last wins: the architecture's default pooling
(CLS for BERT, LAST for decoders; embeddings normalised), the sentence-transformers
modules (`1_Pooling/config.json` picks the pooling; a `Normalize` module normalises,
its absence does not), then `--pooler-config` ('{"pooling_type": "MEAN",
"normalize": false}'). A sentence-transformers module Pagoda cannot reproduce (a
`Dense` projection, max pooling) is refused at start-up rather than served wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pagoda.config import POOLING_TYPES, ModelArchConfig, PoolerConfig
from pagoda.model.registry import MODEL_REGISTRY

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "embed")
_ST_MODULE = "sentence_transformers.models."
# sentence-transformers' pooling modes -> ours (old boolean keys and the newer `pooling_mode`).
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_lasttoken": "LAST", "cls": "CLS", "mean": "MEAN", "lasttoken": "LAST"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """What a sentence-transformers folder says about pooling and input length."""

    pooling_type: str | None
    normalize: bool
    max_seq_length: int | None


@dataclass(frozen=True)
class PoolingSetup:
    """The resolved runner; for a pooling model its pooler and the engine limits it needs.

    Invariant: `pooler_config` is set exactly when `runner == "pooling"`.
    """

    runner: str
    pooler_config: PoolerConfig | None = None
    max_seq_length: int | None = None  # sentence-transformers' input limit, if any
    is_encoder: bool = False

    @property
    def allows_prefix_caching(self) -> bool:
        """Only last-token pooling on a decoder gives the same result from cached KV: the
        pooler then reads one row, which the engine always computes."""
        return self.runner == "generate" or (not self.is_encoder
                                             and self.pooler_config.pooling_type == "LAST")


def read_sentence_transformers_config(model_dir: str) -> SentenceTransformersConfig | None:
    """The folder's modules.json and module configs, or None when it has none.
    ValueError for a module or pooling mode that Pagoda does not reproduce."""
    modules = _read_json(os.path.join(model_dir, "modules.json"))
    if modules is None:
        return None
    pooling_type, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")).removeprefix(_ST_MODULE)
        if kind == "Pooling":
            pooling = _read_json(os.path.join(model_dir, module.get("path", ""), "config.json"))
            pooling_type = _st_pooling_type(pooling or {})
        elif kind == "Normalize":
            normalize = True
        elif kind != "Transformer":
            raise ValueError(f"sentence-transformers module {module.get('type')!r} in "
                             f"{model_dir}/modules.json is not supported (Pagoda reproduces "
                             "Transformer, Pooling and Normalize)")
    bert_config = _read_json(os.path.join(model_dir, "sentence_bert_config.json")) or {}
    return SentenceTransformersConfig(pooling_type, normalize, bert_config.get("max_seq_length"))


def _st_pooling_type(config: dict) -> str:
    if config.get("include_prompt", True) is False:
        raise ValueError("sentence-transformers pooling with include_prompt=false is not "
                         "supported")
    mode = config.get("pooling_mode")
    if mode is not None:
        modes = [mode] if isinstance(mode, str) else list(mode)
    else:
        modes = [key for key in (*_ST_MODES, *_ST_UNSUPPORTED_MODES) if config.get(key)]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ValueError(f"sentence-transformers pooling {modes or 'none'} is not supported; "
                         "supported: one of cls, mean, lasttoken")
    return _ST_MODES[modes[0]]


def resolve_pooling(model_path: str, arch: ModelArchConfig, runner: str = "auto",
                    convert: str = "auto", overrides: dict | str | None = None) -> PoolingSetup:
    """The runner of the model at `model_path` and, for pooling, its `PoolerConfig`."""
    if runner not in RUNNERS:
        raise ValueError(f"Unknown runner {runner!r}; expected one of {', '.join(RUNNERS)}")
    if convert not in CONVERTS:
        raise ValueError(f"Unknown convert {convert!r}; expected one of {', '.join(CONVERTS)} "
                         "(a classifier needs a *ForSequenceClassification checkpoint)")
    model_cls = MODEL_REGISTRY.resolve(arch.architecture).model_cls
    model_dir = model_path if os.path.isdir(model_path) else os.path.dirname(model_path)
    st = read_sentence_transformers_config(model_dir)
    pools_only = getattr(model_cls, "is_pooling_model", False)
    if runner == "auto":
        runner = "pooling" if pools_only or st is not None or convert == "embed" else "generate"
    if runner == "generate":
        if pools_only:
            raise ValueError(f"{arch.architecture} is a pooling model (embeddings, scores): "
                             "serve it with --runner pooling (or auto)")
        if convert != "auto":
            raise ValueError("--convert applies to --runner pooling")
        return PoolingSetup("generate")
    task = "classify" if hasattr(model_cls, "classify") else getattr(model_cls, "pooling_task",
                                                                        "embed")
    size = model_cls.embedding_size(arch) if hasattr(model_cls, "embedding_size") else None
    pooler = PoolerConfig(
        pooling_type=getattr(model_cls, "default_pooling_type", "LAST"), task=task,
        hidden_size=size or arch.hidden_size, labels=_labels(model_dir, arch) if task == "classify" else ())
    if st is not None:
        pooler.pooling_type = st.pooling_type or pooler.pooling_type
        pooler.normalize = st.normalize
    _apply_overrides(pooler, overrides)
    if (pooler.pooling_type == "ALL") != (task == "token_embed"):
        raise ValueError("pooling_type ALL is a late-interaction (token_embed) model's, and "
                         f"only its; this model's task is {task!r}")
    _read_matryoshka(model_dir, pooler)
    pooler.prompts = read_input_type_prompts(model_dir)
    return PoolingSetup("pooling", pooler, st.max_seq_length if st else None,
                        getattr(model_cls, "is_encoder", False))


def _apply_overrides(pooler: PoolerConfig, overrides: dict | str | None) -> None:
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except ValueError as exc:
            raise ValueError(f"--pooler-config is not valid JSON: {exc}") from None
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"--pooler-config: unknown key(s) {', '.join(unknown)}; known: "
                         "normalize, pooling_type")
    if overrides.get("pooling_type") is not None:
        pooler.pooling_type = str(overrides["pooling_type"]).upper()
    if overrides.get("normalize") is not None:
        pooler.normalize = bool(overrides["normalize"])
    if pooler.pooling_type not in POOLING_TYPES:
        raise ValueError(f"Unsupported pooling_type {pooler.pooling_type!r}; supported: "
                         f"{', '.join(POOLING_TYPES)}")


def _read_matryoshka(model_dir: str, pooler: PoolerConfig) -> None:
    """config.json's `is_matryoshka` / `matryoshka_dimensions` (vLLM reads the same keys)."""
    config = _read_json(os.path.join(model_dir, "config.json")) or {}
    dims = config.get("matryoshka_dimensions")
    pooler.is_matryoshka = bool(config.get("is_matryoshka") or dims)
    pooler.matryoshka_dimensions = tuple(int(d) for d in dims or ())


def read_input_type_prompts(model_dir: str) -> tuple[tuple[str, str], ...]:
    """The prefixes a Cohere `input_type` selects (vLLM's sources, first found wins):
    config.json's `task_instructions`, else config_sentence_transformers.json's
    `prompts`; string values only."""
    config = _read_json(os.path.join(model_dir, "config.json")) or {}
    prompts = config.get("task_instructions")
    if not isinstance(prompts, dict) or not prompts:
        st = _read_json(os.path.join(model_dir, "config_sentence_transformers.json")) or {}
        prompts = st.get("prompts")
    if not isinstance(prompts, dict):
        return ()
    return tuple((str(k), v) for k, v in prompts.items() if isinstance(v, str))


def _labels(model_dir: str, arch: ModelArchConfig) -> tuple[str, ...]:
    """A classifier's class names in output order (config.json `id2label`)."""
    config = _read_json(os.path.join(model_dir, "config.json")) or {}
    id2label = {int(k): str(v) for k, v in (config.get("id2label") or {}).items()}
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(arch.num_labels))


def _read_json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
