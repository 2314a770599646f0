"""Qwen2-VL through `pagoda.LLM` equals HF transformers on a tiny random checkpoint with
real images of different shapes (dynamic resolution, M-RoPE): greedy tokens, sample and
prompt logprobs within 1e-4 in float32, with chunks splitting the image runs, 4-token
blocks and prefix hits."""

from __future__ import annotations

import pytest
import torch

from llava_cases import pattern_image
from llava_parity import assert_same, pagoda_results
from pagoda import LLM
from qwen2_vl_cases import IMAGE, save_tiny_qwen2_vl

ENGINE = dict(dtype="float32", enable_prefix_caching=True, block_size=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=512, max_model_len=256)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"), smollm2_tokenizer)


@pytest.fixture(scope="module")
def qwen2_5_vl_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_5_vl"), smollm2_tokenizer,
                              version="2.5")


def _hf(path, text, images):
    """HF's inputs as Qwen2VLProcessor builds them (its constructor wants a video
    processor, which needs torchvision): the image processor over all images at once,
    each <|image_pad|> repeated grid.prod() / merge**2 times in the text, tokenized."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    pixels = AutoImageProcessor.from_pretrained(path, backend="pil")(images=images,
                                                                     return_tensors="pt")
    parts = text.split("<|image_pad|>")
    expanded = parts[0] + "".join("<|image_pad|>" * (int(g.prod()) // 4) + rest
                                  for g, rest in zip(pixels["image_grid_thw"], parts[1:]))
    input_ids = torch.tensor([tokenizer.encode(expanded)])
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                  mm_token_type_ids=(input_ids == image_id).int())
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        logits = model(**inputs).logits[0]
    tokens = out.sequences[0, len(ids):].tolist()
    sample = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    prompt = torch.log_softmax(logits[:-1].float(), -1).gather(
        1, inputs["input_ids"][0, 1:, None])[:, 0].tolist()
    return ids, (tokens, sample, prompt)


@pytest.mark.parametrize("version", ["2", "2.5"])
def test_qwen2_vl_matches_transformers(version, qwen2_vl_dir, qwen2_5_vl_dir):
    path = qwen2_vl_dir if version == "2" else qwen2_5_vl_dir
    cases = [(f"USER: {IMAGE}What is this? ASSISTANT:", [pattern_image(40, 30, 1)]),
             (f"USER: {IMAGE} versus {IMAGE}? ASSISTANT:",
              [pattern_image(50, 26, 2), pattern_image(24, 37, 3)])]
    references = [_hf(path, text, images) for text, images in cases]
    llm = LLM(model=path, **ENGINE)
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in cases]
    for attempt in ("cold", "warm"):
        results, outs = pagoda_results(llm, prompts, MAX_TOKENS, attempt == "cold")
        for (ids, reference), ours, out in zip(references, results, outs):
            assert out.prompt_token_ids == ids
            assert_same(ours, reference)
            if attempt == "warm":
                assert out.num_cached_tokens > 0


def test_hub_config_and_new_layout_give_the_same_answers(qwen2_vl_dir, tmp_path):
    """The hub's config form (`rope_scaling: {type: mrope}`) and current transformers'
    weight names (`model.language_model.*`, `model.visual.*`) load to the same model."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    other = tmp_path / "qwen2_vl_hub"
    shutil.copytree(qwen2_vl_dir, other)
    config = json.loads((other / "config.json").read_text())
    text = config["text_config"]
    text["rope_theta"] = text.pop("rope_parameters")["rope_theta"]
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}
    (other / "config.json").write_text(json.dumps(config))
    tensors = load_file(other / "model.safetensors")

    def new_name(name):
        if name.startswith("visual."):
            return "model." + name
        if name.startswith("model."):
            return "model.language_model." + name.removeprefix("model.")
        return name

    save_file({new_name(k): v for k, v in tensors.items()}, other / "model.safetensors",
              metadata={"format": "pt"})
    prompts = [{"prompt": f"USER: {IMAGE}Describe. ASSISTANT:",
                "multi_modal_data": {"image": pattern_image(33, 45, 6)}}]
    want, _ = pagoda_results(LLM(model=qwen2_vl_dir, **ENGINE), prompts, MAX_TOKENS, False)
    got, _ = pagoda_results(LLM(model=str(other), **ENGINE), prompts, MAX_TOKENS, False)
    assert got[0][0] == want[0][0]
    torch.testing.assert_close(torch.tensor(got[0][1]), torch.tensor(want[0][1]), atol=1e-6, rtol=0)


def test_preemption_keeps_the_m_rope_positions(qwen2_vl_dir):
    """Requests preempted mid-decode recompute prompt and generated tokens at the same
    3-D positions (generated ones at position + delta): the same tokens."""
    from pagoda import SamplingParams
    prompts = [{"prompt": f"USER: {IMAGE}Item {i}? ASSISTANT:",
                "multi_modal_data": {"image": pattern_image(30 + 9 * i, 44 - 5 * i, 50 + i)}}
               for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    roomy = LLM(model=qwen2_vl_dir, **ENGINE).generate(prompts, params, use_tqdm=False)
    tight = LLM(model=qwen2_vl_dir, **{**ENGINE, "num_gpu_blocks_override": 12})
    outs = tight.generate(prompts, params, use_tqdm=False)
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


def test_the_default_encoder_budget_fits_the_largest_image(qwen2_vl_dir):
    """max_pixels 48*48 over (6 * 2)**2 pixels per token: 16 tokens, above the 8-token
    step budget, so the encoder budget (and its cache) default to 16."""
    from pagoda.engine.arg_utils import EngineArgs
    config = EngineArgs(model=qwen2_vl_dir, max_num_batched_tokens=8).create_engine_config()
    assert config.scheduler.max_num_encoder_input_tokens == 16
    assert config.scheduler.encoder_cache_size == 16


def test_image_embeds_with_their_grid_answer_as_the_image(qwen2_vl_dir):
    """vLLM's Qwen2-VL embedding input, {"image_embeds": merger rows, "image_grid_thw"},
    here from transformers' own vision tower, gives the image's answer; bare embeddings
    or rows that do not fit the grid are refused naming image_grid_thw."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText
    image = pattern_image(40, 30, 1)
    pixels = AutoImageProcessor.from_pretrained(qwen2_vl_dir, backend="pil")(
        images=[image], return_tensors="pt")
    hf = AutoModelForImageTextToText.from_pretrained(qwen2_vl_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        features = hf.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"])
    rows = torch.cat(list(getattr(features, "pooler_output", features)))
    grid = pixels["image_grid_thw"]
    prompt = f"USER: {IMAGE}What is this? ASSISTANT:"
    llm = LLM(model=qwen2_vl_dir, **ENGINE)
    want, got = (
        pagoda_results(llm, [{"prompt": prompt, "multi_modal_data": {"image": data}}],
                       MAX_TOKENS)[0][0]
        for data in (image, {"image_embeds": rows, "image_grid_thw": grid}))
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), atol=1e-4, rtol=0)
    for bad in (rows, {"image_embeds": rows[1:], "image_grid_thw": grid}):
        with pytest.raises(ValueError, match="image_grid_thw"):
            llm.generate({"prompt": prompt, "multi_modal_data": {"image": bad}}, use_tqdm=False)


def test_a_pd_decode_side_never_gets_an_item_without_its_grid(qwen2_vl_dir):
    """M-RoPE positions come from each image's grid, so a Qwen2-VL decode replica must
    get the items' data: the gateway keeps it, and the request check refuses a data-less
    item in the words the gateway resends on (media_guard's)."""
    from pagoda.core.media_guard import MISSING_ENCODER_INPUT
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.kv_transfer.params import KVTransferParams
    from pagoda.messages import EngineCoreRequest
    from pagoda.multimodal.inputs import MultiModalFeature
    from pagoda.request_checks import check_request
    from pagoda.sampling_params import SamplingParams
    from pagoda.services.gateway.disagg.media import decode_side_features
    grid = torch.tensor([1, 4, 4])
    item = MultiModalFeature("image", "a" * 64, 1, 4, data={
        "pixel_values": torch.zeros(16, 8), "image_grid_thw": grid})
    lease = KVTransferParams(do_remote_decode=True, block_hashes=[b"h"] * 4)
    assert decode_side_features([item], lease, 4)[0].data is item.data
    config = EngineArgs(model=qwen2_vl_dir, max_model_len=256).create_engine_config()
    decode = EngineCoreRequest("x", [1, 5, 5, 5, 5, 2], SamplingParams(),
                               mm_features=[item.without_data()],
                               kv_transfer_params=KVTransferParams(do_remote_prefill=True))
    with pytest.raises(ValueError, match=f"{MISSING_ENCODER_INPUT}.*image_grid_thw"):
        check_request(decode, config)


def test_served_image_embeds_with_their_grid_reach_the_processor_as_offline(qwen2_vl_dir):
    """The chat part in vLLM's form ({"type": "image_embeds", "image_embeds":
    {"image_embeds": b64, "image_grid_thw": b64}}) through the gateway's parsing and wire
    and the tokenizer service's preprocessing gives the offline prompt and items."""
    import base64
    import io

    from pagoda.multimodal.chat_parts import extract_media
    from pagoda.multimodal.processing import load_mm_processor, process_prompt
    from pagoda.services.common.protocol.tokenizer import media_inputs
    from pagoda.services.tokenizer.media_prompt import MediaPreprocessor

    def b64(tensor):
        buf = io.BytesIO()
        torch.save(tensor, buf)
        return base64.b64encode(buf.getvalue()).decode()

    grid = torch.tensor([[1, 4, 6]])
    rows = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))  # text width
    chat = extract_media([{"role": "user", "content": [
        {"type": "image_embeds", "image_embeds": {"image_embeds": b64(rows),
                                                  "image_grid_thw": b64(grid)}},
        {"type": "text", "text": "What is this?"}]}])
    processor = load_mm_processor(qwen2_vl_dir)
    text = f"USER: {IMAGE}What is this? ASSISTANT:"
    served = MediaPreprocessor(processor, "Qwen2VLForConditionalGeneration", "tiny",
                               cache_gb=0).process(text, media_inputs(chat.media), None, True)
    offline = process_prompt(processor, text, {"image": {"image_embeds": rows,
                                                         "image_grid_thw": grid}})
    assert served.prompt_token_ids == offline.prompt_token_ids
    (got,), (want,) = served.mm_features, offline.mm_features
    assert (got.identifier, got.offset, got.length) == (want.identifier, want.offset, want.length)
    assert torch.equal(got.data["image_embeds"], rows)
    assert got.data["image_grid_thw"].tolist() == [1, 4, 6]
    with pytest.raises(ValueError, match="image_grid_thw"):
        extract_media([{"role": "user", "content": [
            {"type": "image_embeds", "image_embeds": {"image_embeds": b64(rows)}}]}])
