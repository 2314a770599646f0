"""Pagoda: a vLLM-class LLM inference engine.

The engine core lives in this package and imports no service code (gRPC, Redis,
FastAPI). The offline entry point mirrors vLLM's::

    from pagoda import LLM, SamplingParams
    llm = LLM()  # the default SmolLM2-135M-Instruct
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
"""

from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Import the LLM lazily: `import pagoda` stays cheap (no torch) for the CLI and
    # for the gateway, which holds no model code.
    if name == "LLM":
        from pagoda.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
