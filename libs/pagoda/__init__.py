"""Pagoda: a vLLM-class LLM inference engine.

The engine core lives in this package and imports no service code (gRPC, Redis,
FastAPI). The offline entry point mirrors vLLM's::

    from pagoda import LLM, SamplingParams
    llm = LLM()  # the default SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

import os

# torch's OpenMP threads spin between ops by default. With several processes on few
# cores (the local cluster, a shared CI box) the spinning steals the cores the model
# needs: `pagoda bench throughput` measured 160 total tokens/s with spinning against
# 742 without, on the same loaded 2-core machine. Effective only when pagoda is
# imported before torch (the CLI and `from pagoda import LLM` are); users may override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
           "ScoringOutput", "ScoringRequestOutput", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Import the LLM lazily: `import pagoda` stays cheap (no torch) for the CLI and
    # for the gateway, which holds no model code.
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
