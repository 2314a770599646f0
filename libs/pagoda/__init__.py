"""Pagoda: a vLLM-class LLM inference engine.

The engine core lives in this package and imports no service code (gRPC, Redis,
FastAPI). The offline entry point mirrors vLLM's::

    from pagoda import LLM, SamplingParams
    llm = LLM()  # the default SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

import os

# torch's OpenMP threads between parallel regions (set before torch loads; effective
# when pagoda is imported first, as the CLI and `from pagoda import LLM` do; a user's
# own OMP_WAIT_POLICY or GOMP_SPINCOUNT always wins). A decode step runs hundreds of
# small regions; threads that sleep between them pay a futex wake-up each time.
# PAGODA_OMP_SPIN=1 (default): spin briefly (GOMP_SPINCOUNT), measured on a quiet
# 2-core Zen 5: single-stream decode 49 -> 110 tokens/s, `pagoda bench throughput`
# 822 -> 1134 total tokens/s. PAGODA_OMP_SPIN=0: sleep at once (OMP_WAIT_POLICY=PASSIVE),
# for cores shared with other busy processes, where spinning threads wait on a
# descheduled sibling: beside one busy process, 668 (passive) vs 234 tokens/s
# (spinning). `make test` runs with 0 (the suite runs many processes on few cores).
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    if os.environ.get("PAGODA_OMP_SPIN", "1").strip().lower() in ("0", "false", "no", "off"):
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ["GOMP_SPINCOUNT"] = "100000"

from pagoda.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagoda.outputs import (ClassificationOutput, ClassificationRequestOutput, CompletionOutput,
                            EmbeddingOutput, EmbeddingRequestOutput, Logprob, PoolingOutput,
                            PoolingRequestOutput, RequestOutput, ScoringOutput,
                            ScoringRequestOutput)
from pagoda.lora.request import LoRARequest
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob",
           "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "ClassificationOutput", "ClassificationRequestOutput",
           "ScoringOutput", "ScoringRequestOutput", "LoRARequest", "BeamSearchParams",
           "BeamSearchOutput", "BeamSearchSequence"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Import the LLM lazily: `import pagoda` stays cheap (no torch) for the CLI and
    # for the gateway, which holds no model code.
    if name == "LLM":
        # lazy: `import pagoda` stays free of torch for the CLI and the gateway
        from pagoda.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
