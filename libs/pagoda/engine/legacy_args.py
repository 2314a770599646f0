"""vLLM engine flags that are accepted for compatibility but change nothing, or that
map onto newer flags: `--task` (→ `--runner`/`--convert`), `--tokenizer-mode auto`,
`--swap-space`.

vLLM still accepts these on its command line and in `LLM(...)`, so a vLLM command line
moved to Pagoda must not exit with status 2 on them. Each logs a warning saying what it
does here, as vLLM warns on its deprecated options. Invariant: a value these flags
cannot honour (a `--tokenizer-mode` other than the fast HF tokenizer, an unknown task)
is a ValueError, never silently ignored.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)

# vLLM's --task values -> (runner, convert). A pooling task runs the model's own pooler:
# `convert` stays "auto" (a decoder embeds with last-token pooling, an encoder with its
# configured pooling; a classifier checkpoint classifies).
TASK_RUNNERS = {"auto": None, "generate": ("generate", "auto"), "embed": ("pooling", "auto"),
                "embedding": ("pooling", "auto"), "classify": ("pooling", "auto"),
                "score": ("pooling", "auto"), "reward": ("pooling", "auto")}
# The fast HF tokenizer is the only one Pagoda runs; vLLM's "auto" and "hf" mean it.
TOKENIZER_MODES = ("auto", "hf")


def add_legacy_cli_args(parser: argparse.ArgumentParser) -> None:
    """The flags, with vLLM's names; their defaults leave every other flag alone."""
    parser.add_argument("--task", default=None, choices=sorted(TASK_RUNNERS),
                        help="Deprecated in vLLM: use --runner (and --convert). embed, "
                             "classify, score and reward mean --runner pooling; generate "
                             "means --runner generate.")
    parser.add_argument("--tokenizer-mode", default="auto",
                        help="auto or hf: the model's fast HF tokenizer (the only one "
                             "Pagoda runs).")
    parser.add_argument("--swap-space", type=float, default=None, metavar="GiB",
                        help="Accepted for vLLM command lines; no effect: preempted "
                             "requests are recomputed, never swapped.")


def resolve_legacy_args(task: str | None, runner: str, convert: str, tokenizer_mode: str,
                        swap_space: float | None) -> tuple[str, str]:
    """The (runner, convert) to use, after warning about each legacy flag that was set;
    ValueError for a value that cannot be honoured."""
    if tokenizer_mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode {tokenizer_mode!r} is not supported by Pagoda: it "
                         f"runs the model's fast HF tokenizer ({' or '.join(TOKENIZER_MODES)}).")
    if swap_space is not None:
        if swap_space < 0:
            raise ValueError(f"swap_space must be non-negative, got {swap_space}.")
        logger.warning("swap_space (--swap-space) has no effect in Pagoda: preempted "
                       "requests are recomputed, never swapped.")
    if task is None or task == "auto":
        return runner, convert
    if task not in TASK_RUNNERS:
        raise ValueError(f"Unknown task {task!r}; expected one of {', '.join(TASK_RUNNERS)}.")
    task_runner, task_convert = TASK_RUNNERS[task]
    if runner not in ("auto", task_runner):
        raise ValueError(f"task {task!r} means runner {task_runner!r}, but runner {runner!r} "
                         f"was asked for.")
    logger.warning("The 'task' option is deprecated (as in vLLM): task=%r is runner=%r; "
                   "use runner and convert instead.", task, task_runner)
    return task_runner, convert if convert != "auto" else task_convert
