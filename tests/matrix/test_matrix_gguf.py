"""The differential matrix on the default model's own path: a GGUF 4-bit Llama (SmolLM2
Q4_1) in bf16, whose small decode steps run the decoder layers as one C++ call
(`pagoda_cpu::decode_layers`, libs/pagoda/model/cpu_decode_stack.py).

The float32 reference of the other rows cannot stand here (the fused call exists only on
the bf16 int4 path), so this row's reference is the offline engine on the same GGUF and
dtype with the fused call off (PAGODA_CPU_FUSED_DECODE=0: the Python loop over layers).
Both answer the request set in order, one request at a time, so every step has the same
rows on both sides and the fused call must give the loop's bits: the same token ids and
logprobs within the matrix's tolerance. The served worker's log must say it decoded
through the fused call, and the reference must not have (else the row compares a path
with itself).
`make test-matrix` runs this row (PAGODA_MATRIX=full).
"""

from __future__ import annotations

import pytest
from clusters import served
from compare import FP32_LOGPROB_TOL
from request_set import REQUESTS
from rows import check_row
from served import send_all
from test_matrix import record

from pagoda.kernels import cpu as cpu_kernels
from pagoda.model.quantization import gguf_int4

pytestmark = [pytest.mark.matrix, pytest.mark.matrix_full, pytest.mark.slow,
              pytest.mark.skipif(not (gguf_int4.available() and cpu_kernels.available()),
                                 reason="needs torch's int4 CPU kernel and the fused CPU kernels")]

FLAGS = ("--dtype", "bfloat16")
FUSED_LOG = "decoder layers as one C++ call"


def test_default_gguf_fused_decode_answers_as_the_layer_loop(monkeypatch):
    from pagoda import LLM  # lazy: loads the engine
    from pagoda.model.loader import default_model_path  # lazy: as above
    from reference import reference_answers  # lazy: as above

    model = default_model_path()
    monkeypatch.setenv("PAGODA_CPU_FUSED_DECODE", "0")
    llm = LLM(model, dtype="bfloat16", max_model_len=1024, block_size=16)
    tokenizer = llm.get_tokenizer()
    want = reference_answers(llm, REQUESTS)
    assert llm.llm_engine.core.executor.runner.model.model.fused_decode_stack() is None
    del llm
    monkeypatch.delenv("PAGODA_CPU_FUSED_DECODE")
    with served(model, *FLAGS) as serve:
        got = send_all(serve.url, REQUESTS)
        log = "".join(serve.log)
    assert FUSED_LOG in log, "the served worker never took the fused decode path"
    record(check_row("default GGUF Q4_1, bf16, fused decode layers vs the loop", want, got,
                     FP32_LOGPROB_TOL, lambda ids: tokenizer.decode(ids)))
