"""Idefics3 / SmolVLM through `pagoda.LLM` equals HF transformers on a tiny random
checkpoint with real PIL images whose tile grids differ (3 x 3 and 2 x 3 tiles + the
global image, or one frame without splitting): greedy tokens, sample logprobs and
prompt logprobs (float32, within 1e-4), with prefix caching, 4-token blocks and a
6-token step budget (every item's run, tile markers included, is split across chunks),
cold and from prefix hits. Also: the run and its `is_embed` mask equal HF's processor,
`LLM.chat` equals `generate` on the rendered prompt, the same image twice is a prefix
hit, and an unknown checkpoint tensor is refused by name."""

from __future__ import annotations

import functools
import os
import shutil

import pytest
import torch

from idefics3_cases import IMAGE_TOKEN, save_tiny_idefics3
from llava_cases import pattern_image
from llava_parity import assert_same, pagoda_results
from pagoda import LLM, SamplingParams
from pagoda.multimodal.processing import load_mm_processor, process_prompt

ENGINE = dict(dtype="float32", enable_prefix_caching=True, block_size=4,
              max_num_batched_tokens=6,
              num_gpu_blocks_override=512, max_model_len=384)
MAX_TOKENS = 6
PROMPT = "<|im_start|>User:{}What is in the picture?<end_of_utterance>\nAssistant:"


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_idefics3(tmp_path_factory.mktemp("idefics3"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def llm(idefics3_dir):
    return LLM(model=idefics3_dir, **ENGINE)


@functools.lru_cache(maxsize=1)
def _hf_model(path: str):
    from transformers import Idefics3ForConditionalGeneration
    return Idefics3ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def _hf_processor(path: str):
    from transformers import Idefics3Processor
    ours = load_mm_processor(path)
    return Idefics3Processor(image_processor=ours.image_processor, tokenizer=ours.tokenizer,
                             image_seq_len=ours.image_seq_len)


def _hf_reference(path: str, text: str, images, max_tokens: int = MAX_TOKENS, **kwargs):
    """(HF's input ids, (greedy tokens, their logprobs, prompt logprobs))."""
    inputs = _hf_processor(path)(text=text, images=images, return_tensors="pt", **kwargs)
    model = _hf_model(path)
    ids = inputs["input_ids"]
    extra = {k: inputs[k] for k in ("pixel_values", "pixel_attention_mask")}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **extra)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    sample = [torch.log_softmax(step[0].float(), -1)[t].item()
              for step, t in zip(out.logits, tokens)]
    prompt = torch.log_softmax(logits[:-1].float(), -1).gather(
        1, ids[0, 1:, None])[:, 0].tolist()
    return ids[0].tolist(), (tokens, sample, prompt)


CASES = [
    (PROMPT.format(IMAGE_TOKEN), [(40, 52, 1)], {}),  # 3 x 3 tiles + global
    (PROMPT.format(f"{IMAGE_TOKEN} and {IMAGE_TOKEN}"), [(64, 31, 2), (20, 20, 3)], {}),
    (PROMPT.format(IMAGE_TOKEN), [(33, 47, 4)], {"do_image_splitting": False}),  # one frame
]


def test_idefics3_matches_transformers(idefics3_dir, llm):
    prompts, references = [], []
    for text, sizes, kwargs in CASES:
        images = [pattern_image(w, h, seed) for w, h, seed in sizes]
        prompt = {"prompt": text, "multi_modal_data": {"image": images}}
        if kwargs:
            prompt["mm_processor_kwargs"] = kwargs
        prompts.append(prompt)
        references.append(_hf_reference(idefics3_dir, text, images, **kwargs))
    for attempt in ("cold", "warm"):
        results, outs = pagoda_results(llm, prompts, MAX_TOKENS, attempt == "cold")
        for (ids, reference), ours, out in zip(references, results, outs):
            assert out.prompt_token_ids == ids  # the run (tile markers and all) equals HF's
            assert_same(ours, reference)
            if attempt == "warm":
                assert out.num_cached_tokens > 0


def test_runs_and_is_embed_masks(idefics3_dir, llm):
    """Only `<image>` positions take encoder rows; the tile markers and newlines between
    them are text; the run spans HF's whole replacement (first to last fake token)."""
    proc = llm.media.processor
    tok = proc.tokenizer
    image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    fake_id = tok.convert_tokens_to_ids("<fake_token_around_image>")
    text = PROMPT.format(f"{IMAGE_TOKEN} and {IMAGE_TOKEN}")
    images = [pattern_image(64, 31, 2), pattern_image(40, 52, 1)]
    processed = process_prompt(proc, text, {"image": images})
    ids = processed.prompt_token_ids
    for f, grid in zip(processed.mm_features, ([2, 3], [3, 3])):
        run = ids[f.offset:f.end]
        assert f.data["image_grid"].tolist() == grid
        assert run[0] == fake_id and run[-1] == fake_id
        assert f.is_embed.tolist() == [t == image_id for t in run]
        assert f.num_embeds == (grid[0] * grid[1] + 1) * proc.image_seq_len
        assert tok.convert_tokens_to_ids("<row_1_col_1>") in run
        assert tok.convert_tokens_to_ids("<global-img>") in run
    assert sum(f.num_embeds for f in processed.mm_features) == ids.count(image_id)
    # An already-expanded prompt (HF's processor's ids) is kept as it is.
    again = process_prompt(proc, ids, {"image": images})
    assert again.prompt_token_ids == ids
    assert [(f.offset, f.length) for f in again.mm_features] == \
        [(f.offset, f.length) for f in processed.mm_features]


def test_chat_equals_generate_and_same_image_is_a_prefix_hit(idefics3_dir, llm):
    image = pattern_image(44, 36, 6)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "Describe it."}]}]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    rendered = "<|im_start|>User:<image>Describe it.<end_of_utterance>\nAssistant:"
    gen = llm.generate({"prompt": rendered, "multi_modal_data": {"image": image}}, params,
                       use_tqdm=False)[0]
    assert chat.prompt_token_ids == gen.prompt_token_ids
    assert list(chat.outputs[0].token_ids) == list(gen.outputs[0].token_ids)
    # the second run of the same prompt and image reused the first's KV
    assert gen.num_cached_tokens >= len(gen.prompt_token_ids) - 4
    # another image with the same text shares only the blocks before the image's run
    other = llm.generate({"prompt": rendered,
                          "multi_modal_data": {"image": pattern_image(44, 36, 7)}}, params,
                         use_tqdm=False)[0]
    first_run = other.prompt_token_ids.index(
        llm.get_tokenizer().convert_tokens_to_ids("<fake_token_around_image>"))
    assert other.num_cached_tokens <= first_run
    ids, reference = _hf_reference(idefics3_dir, rendered, [image])
    assert gen.prompt_token_ids == ids and list(gen.outputs[0].token_ids) == reference[0]


@pytest.mark.parametrize("tie_text,tie_top", [
    (True, False),
    pytest.param(False, True, marks=pytest.mark.extended),
])
def test_lm_head_tied_as_transformers_ties_it(tie_text, tie_top, tmp_path, smollm2_tokenizer):
    """transformers ties Idefics3's LM head by config.json's top-level
    `tie_word_embeddings`; text_config's (True by default in saved configs) is ignored."""
    path = save_tiny_idefics3(tmp_path / "tie", smollm2_tokenizer, seed=1, tie_text=tie_text,
                              tie_top=tie_top)
    _hf_model.cache_clear()
    image = pattern_image(30, 20, 8)
    text = PROMPT.format(IMAGE_TOKEN)
    ids, reference = _hf_reference(path, text, [image])
    _hf_model.cache_clear()
    engine = LLM(model=path, **ENGINE)
    results, _ = pagoda_results(engine, [{"prompt": text, "multi_modal_data": {"image": image}}],
                                MAX_TOKENS)
    assert_same(results[0], reference)


def test_unknown_checkpoint_tensor_is_refused_by_name(idefics3_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    path = tmp_path / "extra"
    shutil.copytree(idefics3_dir, path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert any(k.startswith("model.vision_model.") for k in tensors)
    assert any(k.startswith("model.connector.modality_projection.") for k in tensors)
    for extra in ("model.vision_model.encoder.extra_head.weight", "vision_model.stray.weight"):
        bad = dict(tensors)
        bad[extra] = torch.zeros(2)
        save_file(bad, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(Exception, match=extra.split(".")[-2]):
            LLM(model=str(path), **ENGINE)


def test_frames_of_another_size_are_refused_naming_max_image_size(llm):
    with pytest.raises(ValueError, match="max_image_size"):
        llm.generate({"prompt": PROMPT.format(IMAGE_TOKEN),
                      "multi_modal_data": {"image": pattern_image(40, 40, 1)},
                      "mm_processor_kwargs": {"max_image_size": {"longest_edge": 20}}},
                     use_tqdm=False)


def test_image_embeds_are_refused_by_name(llm):
    with pytest.raises(ValueError, match="image_embeds"):
        llm.generate({"prompt": PROMPT.format(IMAGE_TOKEN),
                      "multi_modal_data": {"image": {"image_embeds": torch.zeros(4, 64)}}},
                     use_tqdm=False)


@pytest.mark.parametrize("grid", [(4, 4), (3, 3), (5, 2)])
def test_position_buckets_equal_transformers(grid):
    """A frame whose patch grid differs from the tower's (4 x 4 here) takes HF's
    bucketed position ids (fractional coordinates), not the first positions."""
    from transformers.models.idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings as HF

    from pagoda.model.architectures.idefics3 import Idefics3Settings, Idefics3VisionEmbeddings
    config = Idefics3VisionConfig(hidden_size=8, image_size=16, patch_size=4)
    settings = Idefics3Settings.from_hf_config(
        {"vision_config": config.to_dict(), "scale_factor": 2}, None).vision
    torch.manual_seed(0)
    hf = HF(config).eval()
    ours = Idefics3VisionEmbeddings(settings, torch.float32)
    ours.load_state_dict(hf.state_dict())
    pixels = torch.randn(2, 3, grid[0] * 4, grid[1] * 4)
    mask = torch.ones(2, *grid, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(ours(pixels), hf(pixels, mask), atol=0, rtol=0)


def test_the_tokenizer_service_gives_the_offline_features(idefics3_dir, llm):
    """The cluster's processor (the tokenizer service's MediaPreprocessor, an image as a
    data: URL) gives the offline ids and runs, and `is_embed` survives the wire; the
    SmolVLM template renders content parts itself (no placeholder flattening)."""
    import base64
    import io

    from pagoda.multimodal.chat_parts import template_reads_parts
    from pagoda.services._proto.pagoda.tokenizer.v1 import tokenizer_pb2 as pb
    from pagoda.services.common.protocol.multimodal import (features_from_proto,
                                                            features_to_proto)
    from pagoda.services.tokenizer.media_prompt import MediaPreprocessor
    from test_feature_proto import proto

    assert template_reads_parts(llm.get_tokenizer().chat_template)
    image = pattern_image(64, 31, 2)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    service = MediaPreprocessor(llm.media.processor, "Idefics3ForConditionalGeneration",
                                "tiny", cache_gb=0)
    text = PROMPT.format(IMAGE_TOKEN)
    served = service.process(text, [pb.MediaInput(modality="image", url=url)], None, True)
    offline = process_prompt(llm.media.processor, text, {"image": image})
    assert served.prompt_token_ids == offline.prompt_token_ids
    wire = features_from_proto(proto(served.mm_features).mm_features,
                               prompt_len=len(served.prompt_token_ids))
    for got, want in zip(wire, offline.mm_features):
        assert (got.identifier, got.offset, got.length) == (want.identifier, want.offset,
                                                            want.length)
        assert torch.equal(got.is_embed, want.is_embed)
        assert torch.equal(got.data["pixel_values"], want.data["pixel_values"])
