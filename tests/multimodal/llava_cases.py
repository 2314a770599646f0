"""Tiny random LLaVA checkpoints and real PIL images for the multi-modal tests.

`save_tiny_llava` builds `LlavaForConditionalGeneration` with transformers' own config
classes (a CLIP or a SigLIP vision tower, a Llama text model), random weights with a
large init range and random norm weights (every layer visibly moves the logits), saves
it with `save_pretrained` beside SmolLM2's tokenizer with `<image>` added and the tower's
PIL image processor config. `old_layout_copy` rewrites the weights into the hub's older
llava-hf names (`language_model.model.*`, `language_model.lm_head`, `vision_tower.*`).
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from PIL import Image

IMAGE_TOKEN = "<image>"
IMAGE_SIZE = 30  # the tower's input (crop) size
PATCH_SIZE = 6  # 25 patches


def save_tiny_llava(path, tokenizer, tower: str = "clip", seed: int = 0,
                    select_strategy: str | None = None, feature_layer: int = -2) -> str:
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, SiglipVisionConfig)
    tokenizer = _with_image_token(tokenizer)
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vocab = (len(tokenizer) + 63) // 64 * 64
    text = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, rms_norm_eps=1e-5,
                       initializer_range=0.2, eos_token_id=None)
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=PATCH_SIZE)
    if tower == "clip":
        vision = CLIPVisionConfig(projection_dim=32, **common)
        strategy = select_strategy or "default"
    else:
        vision = SiglipVisionConfig(**common)
        strategy = select_strategy or "full"
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                         vision_feature_select_strategy=strategy,
                         vision_feature_layer=feature_layer, projector_hidden_act="gelu")
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embeddings" in name or "projector" in name:
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _image_processor(tower).save_pretrained(path)
    return str(path)


# llava-hf's chat template: a user turn's images first ("<image>\n" each), then its text.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def _with_image_token(tokenizer):
    tokenizer = _copy(tokenizer)
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE
    return tokenizer


def _copy(tokenizer):
    import copy
    return copy.deepcopy(tokenizer)


def _image_processor(tower: str):
    size = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    if tower == "clip":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        return CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=size)
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    return SiglipImageProcessorPil(size=size)


def layout_copy(src: str, dst, layout: str) -> str:
    """The same checkpoint under one layout's tensor names: "new" (transformers' module
    names: `model.vision_tower.*`, `model.language_model.*`, `lm_head.*`) or "old" (the
    hub's llava-hf names: `vision_tower.vision_model.*`, `language_model.model.*`,
    `language_model.lm_head.*`). Returns the names written."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(dst, name))
            save_file({_renamed(_canonical(k), layout): v for k, v in tensors.items()},
                      os.path.join(dst, name), metadata={"format": "pt"})
    return str(dst)


def _canonical(name: str) -> str:
    """Either layout -> (part, rest) joined as 'part|rest'."""
    name = name.removeprefix("model.") if name.split(".")[1] in (
        "vision_tower", "multi_modal_projector", "language_model") else name
    for part in ("vision_tower", "multi_modal_projector"):
        if name.startswith(part + "."):
            return f"{part}|{name.removeprefix(part + '.').removeprefix('vision_model.')}"
    if name.startswith("language_model.lm_head.") or name.startswith("lm_head."):
        return "lm_head|" + name.removeprefix("language_model.").removeprefix("lm_head.")
    rest = name.removeprefix("language_model.").removeprefix("model.")
    return "text|" + rest


def _renamed(canonical: str, layout: str) -> str:
    part, rest = canonical.split("|")
    if layout == "new":
        return {"vision_tower": f"model.vision_tower.{rest}",
                "multi_modal_projector": f"model.multi_modal_projector.{rest}",
                "lm_head": f"lm_head.{rest}", "text": f"model.language_model.{rest}"}[part]
    return {"vision_tower": f"vision_tower.vision_model.{rest}",
            "multi_modal_projector": f"multi_modal_projector.{rest}",
            "lm_head": f"language_model.lm_head.{rest}",
            "text": f"language_model.model.{rest}"}[part]


def pattern_image(width: int, height: int, seed: int) -> Image.Image:
    """A real RGB picture: stripes and a gradient whose colours depend on `seed`."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(0, 256, (3,), generator=g)
    y = torch.arange(height).view(-1, 1, 1)
    x = torch.arange(width).view(1, -1, 1)
    pixels = (base + 40 * ((x // (3 + seed % 5)) % 2) + (y * 255) // max(height, 1)) % 256
    return Image.fromarray(pixels.to(torch.uint8).numpy(), "RGB")


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)
