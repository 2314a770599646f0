"""A tiny random Idefics3 (SmolVLM) checkpoint for the multi-modal tests.

`save_tiny_idefics3` builds `Idefics3ForConditionalGeneration` with transformers' own
config classes (its vision config, a Llama text config), random weights with a large
init range and random norm weights, saves it with `save_pretrained` beside SmolLM2's
tokenizer with SmolVLM's image tokens and chat template added, the PIL image processor
(tiles of 16 px, longest edge 40: a large image gives a 2 x 3 or 3 x 2 grid) and the
processor's `image_seq_len`.

The tower's `image_size` is the tile size, as in every released checkpoint (HF's
`image_seq_len` assumes it).
"""

from __future__ import annotations

import json
import os

import torch

IMAGE_TOKEN = "<image>"
TILE = 16  # max_image_size: the frame side the processor produces
PATCH = 4  # 4 x 4 patches per frame -> pixel shuffle by 2 -> 4 rows per frame
LONGEST_EDGE = 40

# SmolVLM's chat template (a user turn's images and text in order).
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

SPECIAL_TOKENS = (["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
                  + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])


def save_tiny_idefics3(path, tokenizer, seed: int = 0, tie_text: bool = False,
                       tie_top: bool = False) -> str:
    """`tie_text`/`tie_top`: text_config's and config.json's `tie_word_embeddings`
    (transformers ties the LM head by the top-level one)."""
    import copy

    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, LlamaConfig
    from transformers.models.idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil)
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vocab = (len(tokenizer) + 63) // 64 * 64
    text = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, rms_norm_eps=1e-5,
                       initializer_range=0.2, eos_token_id=None, tie_word_embeddings=tie_text)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, image_size=TILE, patch_size=PATCH)
    config = Idefics3Config(vision_config=vision.to_dict(), text_config=text.to_dict(),
                            image_token_id=image_token_id, scale_factor=2,
                            tie_word_embeddings=tie_top)
    config.initializer_range = 0.2
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif "embeddings" in name or "connector" in name:
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Idefics3ImageProcessorPil(size={"longest_edge": LONGEST_EDGE},
                              max_image_size={"longest_edge": TILE}).save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"image_seq_len": image_seq_len(config), "processor_class": "Idefics3Processor"},
                  f)
    return str(path)


def image_seq_len(config) -> int:
    side = config.vision_config.image_size // config.vision_config.patch_size
    return side * side // config.scale_factor ** 2
