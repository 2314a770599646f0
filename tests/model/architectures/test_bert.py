"""BERT (an encoder) against transformers on tiny random checkpoints: hidden states of
several prompts run in one step equal each prompt's own HF forward (attention stays
inside a request), text pairs take token type 1 on their second text, and a
cross-encoder's logits equal BertForSequenceClassification's."""

from __future__ import annotations

import pytest
import torch
from pooling_cases import SENTENCES, build_bert, hf_bert_hidden, hf_cross_encoder_logits

from pagoda.config import CacheConfig
from pagoda.messages import NewRequestData
from pagoda.model.encoder_attention import check_whole_prompts
from pagoda.model.loader import load_arch_config, load_model
from pagoda.pooling_params import PREFILL_ONLY, PoolingParams
from pagoda.worker.batch_state import CachedRequestState
from pagoda.worker.input_builder import build_model_inputs
from pagoda.worker.pooling import token_type_ids

ATOL = 1e-5


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return build_bert(tmp_path_factory.mktemp("cross"), classifier=True, num_labels=1, seed=1)


def step_inputs(prompts: list[list[int]], splits: list[int | None] | None = None):
    """One step running each prompt whole, as the model runner builds it."""
    block_size = CacheConfig().block_size
    states, next_block = {}, 0
    for i, ids in enumerate(prompts):
        num_blocks = -(-len(ids) // block_size)
        split = splits[i] if splits else None
        states[f"r{i}"] = CachedRequestState.from_new(NewRequestData(
            f"r{i}", ids, [], PREFILL_ONLY, list(range(next_block, next_block + num_blocks)), 0,
            PoolingParams(token_type_split=split)), None)
        next_block += num_blocks
    inputs = build_model_inputs(states, {f"r{i}": len(p) for i, p in enumerate(prompts)},
                                block_size, "cpu")
    return states, inputs


def tokenize(model_dir, texts):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(t)["input_ids"] for t in texts]


def test_batched_prompts_equal_each_prompts_own_forward(bert_dir):
    model = load_model(str(bert_dir), load_arch_config(str(bert_dir)), torch.float32)
    assert not hasattr(model, "lm_head") and model.pooler is None
    prompts = tokenize(bert_dir, SENTENCES)
    _, inputs = step_inputs(prompts)
    with torch.no_grad():
        hidden = model(inputs.input_ids, inputs.positions, [], inputs.attn_metadata)
    qsl = inputs.attn_metadata.query_start_loc_cpu
    expected = dict(zip(map(tuple, prompts), hf_bert_hidden(bert_dir, SENTENCES)))
    for i, req_id in enumerate(inputs.req_ids):
        prompt = tuple(prompts[int(req_id[1:])])
        torch.testing.assert_close(hidden[qsl[i]:qsl[i + 1]], expected[prompt], atol=ATOL, rtol=0)


def test_text_pairs_take_token_type_one_on_their_second_text(bert_dir):
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(bert_dir)
    encoded = tokenizer("what is the capital of france?", "paris")
    split = encoded["token_type_ids"].index(1)
    states, inputs = step_inputs([encoded["input_ids"]], [split])
    model = load_model(str(bert_dir), load_arch_config(str(bert_dir)), torch.float32)
    with torch.no_grad():
        ours = model(inputs.input_ids, inputs.positions, [], inputs.attn_metadata,
                     token_type_ids=token_type_ids(states, inputs))
        hf = BertModel.from_pretrained(bert_dir, add_pooling_layer=False).eval()
        theirs = hf(**tokenizer("what is the capital of france?", "paris",
                                return_tensors="pt")).last_hidden_state[0]
        without_types = model(inputs.input_ids, inputs.positions, [], inputs.attn_metadata)
    torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
    assert not torch.allclose(without_types, theirs, atol=1e-3)  # the types matter


def test_cross_encoder_logits_equal_transformers(cross_encoder_dir):
    arch = load_arch_config(str(cross_encoder_dir))
    assert (arch.architecture, arch.num_labels) == ("BertForSequenceClassification", 1)
    model = load_model(str(cross_encoder_dir), arch, torch.float32)
    pairs = [("what is the capital of france?", d) for d in ("paris", "berlin 42", "a dog")]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cross_encoder_dir)
    encoded = [tokenizer(a, b) for a, b in pairs]
    states, inputs = step_inputs([e["input_ids"] for e in encoded],
                                 [e["token_type_ids"].index(1) for e in encoded])
    with torch.no_grad():
        hidden = model(inputs.input_ids, inputs.positions, [], inputs.attn_metadata,
                       token_type_ids=token_type_ids(states, inputs))
        qsl = inputs.attn_metadata.query_start_loc_cpu
        by_request = {r: model.classify(hidden[qsl[i]][None])[0]
                      for i, r in enumerate(inputs.req_ids)}
    expected = hf_cross_encoder_logits(cross_encoder_dir, pairs)
    for i in range(len(pairs)):
        torch.testing.assert_close(by_request[f"r{i}"], expected[i], atol=ATOL, rtol=0)


def test_an_encoder_refuses_a_partial_prompt():
    _, inputs = step_inputs([[2, 5, 6, 3]])
    md = inputs.attn_metadata
    md.seq_lens_cpu[0] += 2  # as if two tokens had been computed in an earlier step
    with pytest.raises(ValueError, match="whole prompt in one step"):
        check_whole_prompts(md)


def test_other_position_embeddings_are_refused(tmp_path):
    build_bert(tmp_path, position_embedding_type="relative_key")
    with pytest.raises(ValueError, match="position_embedding_type='relative_key'"):
        load_arch_config(str(tmp_path))
