"""What a user of images notices in the offline engine: the prefix cache never mixes two
images, the same image is a prefix hit and an encoder-cache hit, limits and text-only
models refuse by name, preemption gives the same answers, chat takes image parts."""

from __future__ import annotations

import pytest

from llava_cases import IMAGE_TOKEN, pattern_image
from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs

ENGINE = dict(dtype="float32", enable_prefix_caching=True, block_size=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=256, max_model_len=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
TEXT = f"USER: {IMAGE_TOKEN}\nWhat is it? ASSISTANT:"


@pytest.fixture(scope="module")
def llm(llava_clip_dir):
    return LLM(model=llava_clip_dir, disable_log_stats=False, **ENGINE)


def _run(llm, text, image, **kw):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": image}}, GREEDY,
                        use_tqdm=False, **kw)[0]


def _stats(llm):
    return llm.llm_engine.core.scheduler.get_stats()


def test_same_text_different_image_shares_no_block_and_same_image_hits(llm):
    red, blue = pattern_image(40, 40, 11), pattern_image(40, 40, 12)
    first = _run(llm, TEXT, red)
    other = _run(llm, TEXT, blue)
    # Block 0 already holds the image's first placeholder ("USER: " is 3 tokens): no
    # block of the second prompt may come from the first.
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    hits_before = _stats(llm).prefix_cache_hits
    again = _run(llm, TEXT, red)
    assert again.num_cached_tokens >= 24  # the whole image run and more
    assert _stats(llm).prefix_cache_hits - hits_before == again.num_cached_tokens
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_same_image_in_another_prompt_hits_the_encoder_cache(llm):
    image = pattern_image(50, 30, 21)
    before = _stats(llm)
    _run(llm, f"USER: {IMAGE_TOKEN}\nFirst question? ASSISTANT:", image)
    mid = _stats(llm)
    assert (mid.encoder_cache_queries - before.encoder_cache_queries,
            mid.encoder_cache_hits - before.encoder_cache_hits) == (1, 0)
    # Other text before the image: no prefix hit on its blocks, but the encoder output
    # is found by the image's content hash.
    out = _run(llm, f"SYSTEM: be brief. USER: {IMAGE_TOKEN}\nSecond? ASSISTANT:", image)
    assert out.num_cached_tokens == 0
    after = _stats(llm)
    assert (after.encoder_cache_queries - mid.encoder_cache_queries,
            after.encoder_cache_hits - mid.encoder_cache_hits) == (1, 1)


def test_too_many_images_are_refused(llava_clip_dir, llm):
    limited = LLM(model=llava_clip_dir, limit_mm_per_prompt={"image": 1}, **ENGINE)
    with pytest.raises(ValueError, match=r"At most 1 image\(s\)"):
        _run(limited, f"{IMAGE_TOKEN} {IMAGE_TOKEN}", [pattern_image(30, 30, 1)] * 2)
    assert not limited.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="1 image placeholder"):  # one placeholder, 2 images
        _run(llm, TEXT, [pattern_image(30, 30, 1)] * 2)


def test_the_cli_flag_is_json(llava_clip_dir):
    import argparse
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--model", llava_clip_dir, "--limit-mm-per-prompt", '{"image": 3}',
         "--mm-processor-cache-gb", "0"]))
    config = args.create_engine_config()
    assert config.multimodal.limit_mm_per_prompt == {"image": 3}
    assert config.multimodal.mm_processor_cache_gb == 0
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        EngineArgs(model=llava_clip_dir, limit_mm_per_prompt='{"image": -1}'
                   ).create_engine_config()


def test_a_text_only_model_refuses_images_by_name(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="LlamaForCausalLM.*text-only"):
        _run(llm, "hello", pattern_image(30, 30, 1))
    from pagoda.messages import EngineCoreRequest
    from pagoda.multimodal.inputs import MultiModalFeature
    from pagoda.request_checks import check_request
    request = EngineCoreRequest("x", [1, 2, 3, 4], SamplingParams(),
                                mm_features=[MultiModalFeature("image", "a" * 64, 1, 2)])
    with pytest.raises(ValueError, match="LlamaForCausalLM.*text-only"):
        check_request(request, llm.llm_engine.config)


@pytest.mark.parametrize("flag", [dict(async_scheduling=True), dict(enable_lora=True),
                                  dict(speculative_config={"method": "ngram",
                                                           "num_speculative_tokens": 2})])
def test_unverified_combinations_are_refused(llava_clip_dir, flag):
    with pytest.raises(ValueError, match="multi-modal model.*not supported with"):
        EngineArgs(model=llava_clip_dir, **flag).create_engine_config()


def test_preemption_recomputes_the_same_answers(llava_clip_dir, llm):
    images = [pattern_image(30 + 7 * i, 40, 30 + i) for i in range(3)]
    prompts = [{"prompt": f"USER: {IMAGE_TOKEN}\nItem {i}? ASSISTANT:",
                "multi_modal_data": {"image": img}} for i, img in enumerate(images)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(model=llava_clip_dir, **{**ENGINE, "num_gpu_blocks_override": 18})
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_chat_with_image_parts_equals_generate(llm):
    image = pattern_image(36, 44, 41)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is it?"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    # llava-hf's template: "USER: <image>\nWhat is it? ASSISTANT:"
    prompt = f"USER: {IMAGE_TOKEN}\nWhat is it? ASSISTANT:"
    ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
    generated = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}},
                             GREEDY, use_tqdm=False)[0]
    assert chat.prompt_token_ids == generated.prompt_token_ids
    assert chat.outputs[0].token_ids == generated.outputs[0].token_ids


def test_chat_takes_a_data_url(llm):
    import base64
    import io
    image = pattern_image(36, 44, 42)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    by_url = llm.chat([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Hi"}]}],
        GREEDY, use_tqdm=False)[0]
    by_pil = llm.chat([{"role": "user", "content": [
        {"type": "image_pil", "image_pil": image}, {"type": "text", "text": "Hi"}]}],
        GREEDY, use_tqdm=False)[0]
    assert by_url.outputs[0].token_ids == by_pil.outputs[0].token_ids
    assert by_pil.num_cached_tokens > 0  # PNG round trip: same pixels, same content hash


def test_items_without_pixels_are_taken_only_by_a_pd_decode_side(llm):
    """The request check: an image without its encoder input is refused unless the
    request says its prompt was prefilled elsewhere (do_remote_prefill); the scheduler
    then refuses it if it would have to compute the image's run (tests/core/
    test_media_guard.py)."""
    from pagoda.kv_transfer.params import KVTransferParams
    from pagoda.messages import EngineCoreRequest
    from pagoda.multimodal.inputs import MultiModalFeature
    from pagoda.request_checks import check_request
    config = llm.llm_engine.config
    prompt = [1, 5, 5, 5, 5, 2, 3]  # the check reads the runs, not the token ids
    item = MultiModalFeature("image", "a" * 64, 1, 4)
    plain = EngineCoreRequest("x", prompt, SamplingParams(), mm_features=[item])
    with pytest.raises(ValueError, match=r"mm_features\[0\]: carries no encoder input"):
        check_request(plain, config)
    prefill = EngineCoreRequest("x", prompt, SamplingParams(), mm_features=[item],
                                kv_transfer_params=KVTransferParams(do_remote_decode=True))
    with pytest.raises(ValueError, match="carries no encoder input"):
        check_request(prefill, config)
    decode = EngineCoreRequest("x", prompt, SamplingParams(), mm_features=[item],
                               kv_transfer_params=KVTransferParams(do_remote_prefill=True))
    check_request(decode, config)

