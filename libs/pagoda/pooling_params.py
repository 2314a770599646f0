"""`PoolingParams`: what a pooling request asks of the model (vLLM's `vllm.pooling_params`).

A pooling request runs its prompt once and returns one vector instead of generated
tokens: an embedding (`task="embed"`), class probabilities (`"classify"`) or the
score of a text pair (`"score"`, a cross-encoder). The engine fills the defaults of
the served model and checks the request against it (`verify`), so a request that
arrives without a task or normalisation flag is completed in one place, the same
offline and served.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.config import PoolerConfig

# The sequence-level tasks a pooling model runs (vLLM's `PoolingTask` without the
# token-level ones). "score" is a classifier's one-label score of a text pair.
# "token_classify" (`LLM.reward`) classifies every prompt token: one row of label
# probabilities per token (vLLM's token reward models). "token_embed": a late-interaction
# model's per-token embeddings, flattened (token-major).
POOLING_TASKS = ("embed", "classify", "score", "token_classify", "token_embed")
TOKEN_TASKS = ("token_classify",)  # classify tasks whose output has one row per prompt token
# The request fields each task reads (vLLM's `valid_parameters`); the rest must be unset.
_TASK_FIELDS = {"embed": ("dimensions", "normalize"), "classify": ("use_activation",),
                "score": ("use_activation",), "token_classify": ("use_activation",),
                "token_embed": ("normalize",)}
_TASK_SPECIFIC = ("dimensions", "normalize", "use_activation")

# What a pooling request is scheduled with: the prompt and one step, no sampling. Every
# engine part that reads sampling params (the prefix-cache lookup, the context check)
# then sees a plain prefill; the worker pools instead of sampling.
PREFILL_ONLY = SamplingParams(max_tokens=1)


@dataclass
class PoolingParams:
    """Parameters of one pooling request, with vLLM's names.

    Invariant: after `verify` (the engine calls it on intake) `task` is set and every
    field the task reads has its value (the model's default when the request left it
    None); fields of another task are None. Invalid values raise ValueError naming
    the field.
    """

    # Keep only the last k prompt tokens (-1: the model's context length); applied
    # where the prompt is tokenized, before the request reaches the engine.
    truncate_prompt_tokens: int | None = None
    # embed: keep the first `dimensions` of a matryoshka embedding.
    dimensions: int | None = None
    # embed: L2-normalise the embedding (default: the model's pooler config).
    normalize: bool | None = None
    # classify / score: apply the classifier's activation (softmax, or sigmoid for a
    # one-label head); False returns the raw logits.
    use_activation: bool | None = None
    task: str | None = None
    # Set by the scoring entry points, not by users: prompt positions from this index
    # on hold the second text of a pair (BERT's token type 1). None: one text.
    token_type_split: int | None = None

    def __post_init__(self) -> None:
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < -1:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's context length) "
                             f"or positive, got {self.truncate_prompt_tokens}.")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's context length) "
                             "or positive, got 0.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"Unknown pooling task {self.task!r}; expected one of "
                             f"{', '.join(POOLING_TASKS)}.")
        if self.token_type_split is not None and self.token_type_split < 0:
            raise ValueError(f"token_type_split must not be negative, got "
                             f"{self.token_type_split}.")

    def clone(self) -> "PoolingParams":
        return copy.deepcopy(self)

    def verify(self, task: str, pooler_config: "PoolerConfig", model_name: str = "") -> None:
        """Fix the task, fill the model's defaults and check what the model supports
        (vLLM's `verify`). ValueError with vLLM's wording otherwise."""
        if self.task is None:
            self.task = task
        elif self.task != task:
            raise ValueError(f"You cannot overwrite task={self.task!r} with task={task!r}!")
        if task not in pooler_config.supported_tasks:
            raise ValueError(f"The model does not support the {task!r} pooling task; it "
                             f"supports {', '.join(pooler_config.supported_tasks)}.")
        wrong = [name for name in _TASK_SPECIFIC
                 if name not in _TASK_FIELDS[task] and getattr(self, name) is not None]
        if wrong:
            raise ValueError(f"Task {task} only supports {list(_TASK_FIELDS[task])} parameters, "
                             f"does not support {wrong} parameters")
        if task in ("embed", "token_embed"):
            if self.normalize is None:
                self.normalize = pooler_config.normalize
            if self.dimensions is not None:
                self._check_dimensions(pooler_config, model_name)
        elif self.use_activation is None:
            self.use_activation = True

    def _check_dimensions(self, pooler_config: "PoolerConfig", model_name: str) -> None:
        if not pooler_config.is_matryoshka:
            raise ValueError(f'Model "{model_name}" does not support matryoshka '
                             "representation, changing output dimensions will lead to poor "
                             "results.")
        allowed = pooler_config.matryoshka_dimensions
        if allowed and self.dimensions not in allowed:
            raise ValueError(f'Model "{model_name}" only supports {list(allowed)} matryoshka '
                             "dimensions, use other output dimensions will lead to poor "
                             "results.")
        if self.dimensions > pooler_config.hidden_size:
            raise ValueError(f"dimensions must be at most the model's embedding size "
                             f"{pooler_config.hidden_size}, got {self.dimensions}.")
