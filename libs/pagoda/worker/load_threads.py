"""How many torch threads a model load uses (`PAGODA_LOAD_THREADS`).

A load is thousands of short parallel regions (dequantizing, casting, the GGUF int4
re-packing), and between them torch's OpenMP threads spin (`PAGODA_OMP_SPIN=1`, the
default, which single-stream decode needs). When the cores are shared with other
starting processes, as `pagoda serve` starts every service of a cluster at once, a
spinning thread waits on a descheduled sibling and burns the core another service
needs: on the 2-core machine the default model's load took 7.5 s of CPU with torch's
2 threads and 3.5 s with one, and ended sooner. `pagoda serve` therefore sets
`PAGODA_LOAD_THREADS` for its gpu-workers to the cores its other services leave.

Invariant: only the number of threads changes, never a result. Every step inside the
window is exact whatever the thread count (element-wise casts and arithmetic, min/max,
copies and re-layouts): the loaded weights are bit-equal. The oneDNN prepacking, whose
kernel choice might consider the thread count, runs after the window, as do all steps.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

import pagoda.envs as envs  # the module, not the package: `pagoda` imports LLM, which loads workers

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def load_threads() -> Iterator[None]:
    """Run the body with at most `PAGODA_LOAD_THREADS` torch threads (unset: torch's
    own count), and give torch back its count afterwards, on error too."""
    wanted = envs.get("PAGODA_LOAD_THREADS")
    saved = torch.get_num_threads()
    if wanted is None or wanted >= saved:
        yield
        return
    torch.set_num_threads(wanted)
    logger.info("loading with %d torch thread(s) of %d (PAGODA_LOAD_THREADS)", wanted, saved)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
