"""The matrix's reference: the offline engine (`pagoda.LLM`) in float32 on the same model
with the served clusters' shape flags (PLAIN_TINY_FLAGS: 1,024 tokens, 16-token blocks).

A request's constraint is built by the gateway's own request models (the one conversion
of response_format and tool_choice to StructuredOutputsParams), and a chat request's
prompt by the same chat template call the gateway makes (tools included), so the
reference and a served path differ only in what the matrix tests: how the tokens are
computed."""

from __future__ import annotations

from pagoda import LLM, SamplingParams
from pagoda.services.gateway.openai.request_models import (ChatCompletionRequest,
                                                           CompletionRequest)
from pagoda.tokenizer.chat import apply_chat_template

from compare import Answer, Choice
from request_set import TOP_LOGPROBS, MatrixRequest
from served import openai_body, top_k


def reference_llm(model_dir: str, **kwargs) -> LLM:
    """The offline engine with the served clusters' shape (PLAIN_TINY_FLAGS)."""
    return LLM(model_dir, dtype="float32", max_model_len=1024, block_size=16, **kwargs)


def sampling_params(request: MatrixRequest) -> SamplingParams:
    """The request as the offline engine's params: its `params`, TOP_LOGPROBS logprobs,
    and the constraint the gateway would build from the same body."""
    body = {"model": "tiny", **openai_body(request)}
    model = ChatCompletionRequest(**body) if request.messages else CompletionRequest(**body)
    constraint = model.structured_output_params()
    return SamplingParams(**request.params, logprobs=TOP_LOGPROBS,
                          **({"structured_outputs": constraint} if constraint else {}))



def reference_answers(llm: LLM, requests, lora_request=None) -> dict[str, Answer]:
    """Every request's answer from `llm`, one request at a time, in order (the prefix
    requests rely on it: the second finds the first's blocks cached)."""
    tokenizer = llm.get_tokenizer()
    answers = {}
    for request in requests:
        if request.messages:
            ids = apply_chat_template(tokenizer, request.messages, tools=request.tools)
            prompt = {"prompt_token_ids": ids}
        else:
            prompt = request.prompt
        [output] = llm.generate([prompt], sampling_params(request), use_tqdm=False,
                                lora_request=lora_request)
        choices = []
        for out in sorted(output.outputs, key=lambda o: o.index):
            top = [top_k({t: lp.logprob for t, lp in row.items()}) for row in out.logprobs]
            chosen = [row[t].logprob for t, row in zip(out.token_ids, out.logprobs)]
            choices.append(Choice(list(out.token_ids), chosen, top, out.text,
                                  out.finish_reason))
        answers[request.name] = Answer(choices, len(output.prompt_token_ids))
    return answers
