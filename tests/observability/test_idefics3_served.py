"""Idefics3 / SmolVLM through the served cluster: `pagoda serve` on a tiny random
checkpoint, the openai client sends an image whose tiles give a 3 x 3 grid (a data:
URL) and the answer equals offline `LLM.chat`'s, whose tokens equal HF transformers'
(`tests/multimodal/test_idefics3.py`). The run's `is_embed` mask (only `<image>`
positions take encoder rows) travels typed from the tokenizer service to the worker."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import pytest
from serve_cluster import ServeProcess

from pagoda import LLM, SamplingParams
from pagoda.services.common.redis_server import PrivateRedis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "multimodal"))
from idefics3_cases import save_tiny_idefics3  # noqa: E402
from llava_cases import pattern_image  # noqa: E402
from test_multimodal_served import MAX_TOKENS, ask, messages, png  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.extended]


def test_a_served_smolvlm_image_answers_as_offline(tmp_path, smollm2_tokenizer):
    path = save_tiny_idefics3(tmp_path / "idefics3", smollm2_tokenizer)
    url = "data:image/png;base64," + base64.b64encode(png(pattern_image(40, 52, 1))).decode()
    llm = LLM(model=path, dtype="float32", max_model_len=512)
    want = llm.chat(messages(url), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert want.prompt_token_ids.count(llm.get_tokenizer().convert_tokens_to_ids("<image>")) \
        == 10 * 4  # 3 x 3 tiles + the global image, 4 rows each
    del llm
    with PrivateRedis() as redis:
        serve = ServeProcess([path, "--served-model-name", "llava", "--dtype", "float32",
                              "--max-model-len", "512", "--block-size", "16",
                              "--redis-url", redis.url])
        try:
            assert ask(serve, url) == want.outputs[0].text
            assert ask(serve, url) == want.outputs[0].text  # again: a prefix hit
        finally:
            assert serve.stop() == 0, serve.stderr_text()[-3000:]
