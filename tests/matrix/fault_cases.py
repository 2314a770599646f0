"""The fault matrix's requests, its reference and its fault switch (test_matrix_faults.py).

- Requests: greedy completions of token-id prompts of 20 full blocks and a bit (so a P/D
  request pulls two IMPORT_BATCHes of 16 blocks), each prompt used once per cluster (the
  decode replica then holds none of its blocks), with logprobs and token ids.
- Reference: the offline float32 engine (`pagoda.LLM`) on the same model folder: in
  float32 every path is token-identical to it (ARCHITECTURE.md).
- Faults: `FaultFile` writes the spec pagoda.fault_injection reads (the cluster is
  started with PAGODA_FAULT_INJECT=@<its path>), replaced whole on every change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fault_file import FaultFile  # noqa: F401 - re-exported: the fault matrix's switch

BLOCK_SIZE = 16
NUM_BLOCKS = 20
MAX_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3


def prompt(case: int, num_blocks: int = NUM_BLOCKS) -> list[int]:
    """Case `case`'s prompt: `num_blocks` full blocks and 5 tokens, no block shared with
    another case's (the first token differs)."""
    return [1000 + case] + [(7 * case + 13 * i) % 30000 + 200
                            for i in range(1, num_blocks * BLOCK_SIZE + 5)]


@dataclass
class Answer:
    """One completion: its token ids, each token's logprob, and how it finished."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None


def first_difference(got: Answer, want: Answer) -> str | None:
    """None when `got` is the reference `want` (same token ids, logprobs within
    LOGPROB_TOLERANCE), else a message naming the first token that differs."""
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:
            return f"token {i} differs: got id {a}, the reference has {b} " \
                   f"(got {got.token_ids}, want {want.token_ids})"
    if len(got.token_ids) != len(want.token_ids):
        return f"{len(got.token_ids)} tokens, the reference has {len(want.token_ids)}: " \
               f"got {got.token_ids}, want {want.token_ids}"
    for i, (a, b) in enumerate(zip(got.logprobs, want.logprobs)):
        if abs(a - b) > LOGPROB_TOLERANCE:
            return f"token {i} (id {got.token_ids[i]}): logprob {a} vs the reference's {b}"
    return None


def assert_reference(got: Answer, want: Answer) -> None:
    problem = first_difference(got, want)
    assert problem is None, problem


class Reference:
    """The offline engine's answers, loaded on first use."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        self._llm = None

    def answer(self, prompt_ids: list[int], structured: dict | None = None) -> Answer:
        # lazy: the engine and its model load only when a case asks for the reference
        from pagoda import LLM, SamplingParams
        from pagoda.sampling_params import StructuredOutputsParams

        if self._llm is None:
            self._llm = LLM(model=self.model_dir, dtype="float32", max_model_len=1024,
                            block_size=BLOCK_SIZE)
        params = SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=structured is None,
            structured_outputs=StructuredOutputsParams(**structured) if structured else None)
        out = self._llm.generate({"prompt_token_ids": prompt_ids}, params,
                                 use_tqdm=False)[0].outputs[0]
        logprobs = [row[token].logprob for row, token in zip(out.logprobs, out.token_ids)]
        return Answer(list(out.token_ids), logprobs, out.finish_reason)


def served(client, prompt_ids: list[int], structured: dict | None = None) -> Answer:
    """The cluster's answer through the official client (token ids from vLLM's
    `return_tokens_as_token_ids`). Raises the client's error for an error answer."""
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": structured is None}
    if structured:
        extra["structured_outputs"] = structured
    out = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=MAX_TOKENS,
                                    temperature=0.0, logprobs=1, extra_body=extra)
    choice = out.choices[0]
    tokens = choice.logprobs.tokens if choice.logprobs else []
    return Answer([int(t.removeprefix("token_id:")) for t in tokens],
                  list(choice.logprobs.token_logprobs) if choice.logprobs else [],
                  choice.finish_reason)
