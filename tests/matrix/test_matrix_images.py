"""The differential matrix on images (issue 27): a tiny random LLaVA (CLIP tower +
projector + Llama, tests/multimodal/llava_cases.py) answers an image request set through
`pagoda serve` and the openai client exactly as offline `LLM.chat` does in float32 on
the same weights (the same token ids, logprobs within 1e-4, the same expanded prompt
length):
- plain colocated;
- 8-token prefill chunks: every image's 25-token placeholder run is split over several
  steps (its encoder output read from the worker's encoder cache by the later chunks),
  and the two-image request encodes its images in different steps (the encoder budget
  is one image);
- a KV pool small enough that the set sent at once preempts: preempted requests
  recompute their image runs (encoded again or read from the encoder cache).

The image request set: data: URLs of distinct PIL patterns; the prefix pair sends the
same image with the same long preface and different questions (the second reuses the
first's blocks, whose hashes carry the image's hash, and its image run is all cached);
the greedy request's image comes back in the two-image request (an encoder-cache or
processor-cache hit, at another offset); a seeded request (sampling with a seed gives
the reference's tokens on every non-speculative path); a request with the greedy
request's text and another image (no block from the image on may be shared).
- P/D (1 prefill + 1 decode replica, PagodaConnector): the prefill side encodes, the
  decode side pulls the image prompts' blocks (keyed by the images) and decodes.
`make test-matrix` runs these rows (PAGODA_MATRIX=full).
"""

from __future__ import annotations

import base64
import io

import pytest
from clusters import served
from compare import FP32_LOGPROB_TOL, Answer, Choice
from llava_cases import pattern_image, save_tiny_llava
from request_set import GREEDY, SHARED, TOP_LOGPROBS, MatrixRequest
from rows import check_row
from served import send_all, top_k
from test_matrix import run_pd
from test_matrix_families import metric, preempting_row, record

pytestmark = [pytest.mark.matrix, pytest.mark.matrix_full, pytest.mark.slow]

# The tiny LLaVA's text model has 512 positions (the matrix's other models 1,024).
MAX_MODEL_LEN = 512
IMAGE_FLAGS = ("--max-model-len", str(MAX_MODEL_LEN))


def data_url(width: int, height: int, seed: int) -> str:
    buf = io.BytesIO()
    pattern_image(width, height, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _user(*parts: str | tuple[int, int, int]) -> list[dict]:
    """One user turn: a tuple is a (width, height, seed) image, a str a text part."""
    content = [{"type": "image_url", "image_url": {"url": data_url(*p)}}
               if isinstance(p, tuple) else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


RED, STRIPES, WIDE = (40, 52, 1), (33, 47, 7), (64, 30, 3)
IMAGE_REQUESTS: tuple[MatrixRequest, ...] = (
    MatrixRequest("greedy", "greedy", {**GREEDY, "max_tokens": 16, "ignore_eos": True},
                  messages=_user(RED, "What is in the picture?")),
    MatrixRequest("seeded", "seeded", {"temperature": 0.8, "seed": 1234, "max_tokens": 16,
                                       "ignore_eos": True},
                  messages=_user(STRIPES, "Describe the colours.")),
    # The same image and preface, another question: the second is served from the
    # first's cached blocks (names as in request_set: send_all keeps them in order).
    MatrixRequest("prefix-first", "prefix", {**GREEDY, "max_tokens": 12, "ignore_eos": True},
                  messages=_user(WIDE, SHARED + "Who keeps the lighthouse?")),
    MatrixRequest("prefix-second", "prefix", {**GREEDY, "max_tokens": 12, "ignore_eos": True},
                  messages=_user(WIDE, SHARED + "When is the market held?")),
    # The greedy request's text with another image: its blocks from the image on may
    # not be the greedy request's (placeholder tokens are equal, the hashes must differ).
    MatrixRequest("other-image", "prefix", {**GREEDY, "max_tokens": 16, "ignore_eos": True},
                  messages=_user(STRIPES, "What is in the picture?")),
    # Two images, the first the greedy request's (already encoded, at another offset).
    MatrixRequest("two-images", "long", {**GREEDY, "max_tokens": 16, "ignore_eos": True},
                  messages=_user(RED, (50, 37, 4), "Which picture is brighter?")),
)


def reference_answers(model: str) -> tuple[dict[str, Answer], object]:
    """Every image request's answer from offline `LLM.chat` (float32, 16-token blocks),
    one at a time, without prefix caching (a wrong cache hit on the served side, e.g.
    blocks of another image, cannot be matched by the same hit here); and the
    tokenizer's decode."""
    from pagoda import LLM  # lazy: loads the engine
    from reference import sampling_params  # lazy: as above

    llm = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=16,
              enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    answers = {}
    for request in IMAGE_REQUESTS:
        [output] = llm.chat(request.messages, sampling_params(request), use_tqdm=False)
        choices = []
        for out in sorted(output.outputs, key=lambda o: o.index):
            top = [top_k({t: lp.logprob for t, lp in row.items()}, TOP_LOGPROBS)
                   for row in out.logprobs]
            chosen = [row[t].logprob for t, row in zip(out.token_ids, out.logprobs)]
            choices.append(Choice(list(out.token_ids), chosen, top, out.text,
                                  out.finish_reason))
        answers[request.name] = Answer(choices, len(output.prompt_token_ids))
    del llm  # its KV pool is large: not held while the clusters run
    return answers, lambda ids: tokenizer.decode(ids)


@pytest.fixture(scope="module")
def llava(tmp_path_factory, smollm2_tokenizer):
    """(model dir, its offline fp32 answers, decode)."""
    model = save_tiny_llava(tmp_path_factory.mktemp("matrix_llava"), smollm2_tokenizer)
    return (model, *reference_answers(model))


@pytest.mark.parametrize("title,flags", [
    ("LLaVA (images): plain", []),
    ("LLaVA (images): chunked prefill, 8-token chunks (image runs split)",
     ["--max-num-batched-tokens", "8"]),
])
def test_image_path(llava, title, flags):
    model, want, decode = llava
    with served(model, *IMAGE_FLAGS, *flags) as serve:
        worker = serve.service_args("gpu-worker")
        got = send_all(serve.url, IMAGE_REQUESTS)
        hits = metric(serve, "vllm:prefix_cache_hits_total")
    assert all(flag in worker for flag in flags if flag.startswith("--")), worker
    # The prefix pair shares its image run's blocks (the hashes carry the image's).
    assert hits >= 16, f"the repeated image was no prefix hit ({hits:.0f} tokens)"
    record(check_row(title, want, got, FP32_LOGPROB_TOL, decode, requests=IMAGE_REQUESTS,
                     notes=f"{hits:.0f} prefix-hit tokens"))


# Prompts of ~40-150 tokens (3-10 blocks with their answers): the longest fits alone,
# the set at once (~30 blocks) does not.
IMAGE_POOL_BLOCKS = 14


def test_image_preempting(llava):
    """Preempted image requests recompute their image runs: the reference's answers."""
    record(preempting_row("LLaVA (images)", *llava, blocks=IMAGE_POOL_BLOCKS,
                          requests=IMAGE_REQUESTS, flags=IMAGE_FLAGS))


def test_image_pd(llava):
    """1 prefill + 1 decode replica: the image prompts' blocks move (the row checks that
    blocks moved) and the decode side answers as the offline engine."""
    model, want, decode = llava
    record(*run_pd(model, want, decode, "LLaVA (images): P/D, PagodaConnector",
                   *IMAGE_FLAGS, requests=IMAGE_REQUESTS))
