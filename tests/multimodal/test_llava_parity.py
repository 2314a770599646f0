"""LLaVA through `pagoda.LLM` equals HF transformers on tiny random checkpoints with real
images: greedy tokens, sample logprobs and prompt logprobs (float32, within 1e-4), with
prefix caching, 4-token blocks and an 8-token step budget (each image's 25-token run is
split across chunks), cold and again from prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from llava_cases import IMAGE_TOKEN, pattern_image
from llava_parity import assert_same, hf_reference, pagoda_results
from pagoda import LLM
from pagoda.multimodal.processing import load_mm_processor, process_prompt

ENGINE = dict(dtype="float32", enable_prefix_caching=True, block_size=4,
              max_num_batched_tokens=8, num_gpu_blocks_override=512, max_model_len=256)
MAX_TOKENS = 6


def _hf_inputs(path: str, text: str, images):
    """HF's own LlavaProcessor builds the reference input ids and pixels."""
    from transformers import LlavaProcessor
    ours = load_mm_processor(path)
    hf = LlavaProcessor(image_processor=ours.image_processor, tokenizer=ours.tokenizer,
                        patch_size=ours.patch_size,
                        vision_feature_select_strategy=ours.select_strategy,
                        num_additional_image_tokens=ours.num_additional_tokens)
    out = hf(text=text, images=images, return_tensors="pt")
    return out["input_ids"][0].tolist(), out["pixel_values"]


@pytest.mark.parametrize("tower", ["clip", "siglip"])
def test_llava_matches_transformers(tower, llava_clip_dir, llava_siglip_dir):
    path = llava_clip_dir if tower == "clip" else llava_siglip_dir
    cases = [(f"USER: {IMAGE_TOKEN}\nWhat is in the picture? ASSISTANT:",
              [pattern_image(40, 52, 1)]),
             (f"USER: {IMAGE_TOKEN} and {IMAGE_TOKEN} differ how? ASSISTANT:",
              [pattern_image(64, 31, 2), pattern_image(30, 30, 3)])]
    llm = LLM(model=path, **ENGINE)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases]
    references = []
    for text, images in cases:
        ids, pixels = _hf_inputs(path, text, images)
        references.append((ids, hf_reference(path, ids, pixels, MAX_TOKENS)))
    for attempt in ("cold", "warm"):
        results, outs = pagoda_results(llm, prompts, MAX_TOKENS, attempt == "cold")
        for (ids, reference), ours, out in zip(references, results, outs):
            assert out.prompt_token_ids == ids  # placeholder expansion equals HF's
            assert_same(ours, reference)
            if attempt == "warm":
                assert out.num_cached_tokens > 0
    pool = llm.llm_engine.core.scheduler.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks


# transformers 5's save_pretrained writes the hub's llava-hf names, so the parity test
# above already loads the old layout: its rewrite runs in make test-extended only.
@pytest.mark.parametrize("layout", ["new", pytest.param("old", marks=pytest.mark.extended)])
def test_both_checkpoint_layouts_load_and_match(layout, llava_clip_dir, llava_clip_layouts):
    from safetensors import safe_open
    path = llava_clip_layouts[layout]
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        names = list(f.keys())
    prefix = "model.language_model." if layout == "new" else "language_model.model."
    assert any(n.startswith(prefix) for n in names)
    text = f"USER: {IMAGE_TOKEN}\nDescribe. ASSISTANT:"
    image = pattern_image(33, 47, 5)
    llm = LLM(model=path, **ENGINE)
    results, _ = pagoda_results(llm, [{"prompt": text, "multi_modal_data": {"image": image}}],
                                MAX_TOKENS)
    ids, pixels = _hf_inputs(llava_clip_dir, text, [image])
    assert_same(results[0], hf_reference(llava_clip_dir, ids, pixels, MAX_TOKENS))


@pytest.mark.extended  # make test-extended: the parity tests cover the pixel path
def test_image_embeds_and_token_id_prompts_match_pixels(llava_clip_dir):
    """vLLM's embedding input ({"image": {"image_embeds": t}}) and a prompt_token_ids
    prompt give the same tokens as the pixels."""
    llm = LLM(model=llava_clip_dir, **ENGINE)
    image = pattern_image(45, 45, 7)
    text = f"USER: {IMAGE_TOKEN}\nWhat? ASSISTANT:"
    processed = process_prompt(llm.media.processor, text, {"image": image})
    runner_model = _runner_model(llm)
    with torch.no_grad():
        embeds = runner_model.embed_multimodal([processed.mm_features[0].data])[0]
    ids = llm.get_tokenizer().encode(text)
    prompts = [{"prompt": text, "multi_modal_data": {"image": image}},
               {"prompt": text, "multi_modal_data": {"image": {"image_embeds": embeds[None]}}},
               {"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}]
    results, _ = pagoda_results(llm, prompts, MAX_TOKENS)
    assert results[0][0] == results[1][0] == results[2][0]
    torch.testing.assert_close(torch.tensor(results[1][1]), torch.tensor(results[0][1]),
                               atol=1e-5, rtol=0)


def _runner_model(llm):
    return llm.llm_engine.core.executor.runner.model  # the in-process executor


def test_a_prefix_hit_that_ends_inside_the_image_run_matches_transformers(llava_clip_dir):
    """The second prompt shares the first's image and the text before it, but not the
    token right after the run, so its prefix hit ends inside the run (the run's tail is
    recomputed from the encoder cache): still HF's answer."""
    image = pattern_image(41, 38, 9)
    llm = LLM(model=llava_clip_dir, **ENGINE)
    first = f"USER:{IMAGE_TOKEN}\nWhat? ASSISTANT:"
    second = f"USER:{IMAGE_TOKEN} Describe it. ASSISTANT:"
    pagoda_results(llm, [{"prompt": first, "multi_modal_data": {"image": image}}], MAX_TOKENS,
                   prompt_logprobs=False)
    results, outs = pagoda_results(llm, [{"prompt": second, "multi_modal_data": {"image": image}}],
                                   MAX_TOKENS, prompt_logprobs=False)
    ids, pixels = _hf_inputs(llava_clip_dir, second, [image])
    image_id = ids[ids.index(llm.media.processor.placeholder_token_ids["image"])]
    start = ids.index(image_id)
    end = start + ids.count(image_id)
    assert start < outs[0].num_cached_tokens < end  # the hit ends inside the run
    assert_same(results[0], hf_reference(llava_clip_dir, ids, pixels, MAX_TOKENS))
