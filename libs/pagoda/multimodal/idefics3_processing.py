"""Idefics3 / SmolVLM preprocessing (transformers' `Idefics3Processor`, per item): the
PIL image processor splits an image into square tiles plus a global image, and the
item's placeholder run interleaves text tokens with the `<image>` rows:

    rows x cols tiles (a large image):
      <fake><row_1_col_1><image>*N <fake><row_1_col_2><image>*N ... \\n      (each row)
      ...
      \\n<fake><global-img><image>*N<fake>
    one frame (the image fits one tile, or do_image_splitting=False):
      <fake><global-img><image>*N<fake>

N = image_seq_len = (image_size // patch_size)^2 / scale_factor^2 rows per frame. The
whole replacement is the item's run (vLLM's `PromptUpdateDetails.select_token_id`);
`is_embed` marks its `<image>` positions only, so the encoder's rows (frames in the
processor's order, tiles row-major then the global image) land on those and the
`<fake_token_around_image>`/`<row_i_col_j>`/`<global-img>`/newline tokens keep their
text embeddings, as HF's `inputs_merger` does.

The run's token ids are HF's: the replacement text is tokenized with one `<image>` per
frame (a special token: the tokenizer splits around it, so the expansion to N copies
is exact), and newlines tokenize as HF's full-prompt tokenization gives them ("\\n\\n"
may be one token).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from pagoda.multimodal.inputs import IMAGE
from pagoda.multimodal.processing import MultiModalProcessor

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"


def image_seq_len(hf_config: Mapping[str, Any]) -> int:
    """Rows of one frame after the pixel shuffle (HF's `Idefics3Model.image_seq_len`)."""
    vision = hf_config.get("vision_config") or {}
    side = int(vision.get("image_size", 224)) // int(vision.get("patch_size", 32))
    return int(side * side / int(hf_config.get("scale_factor", 2)) ** 2)


class Idefics3Processor(MultiModalProcessor):
    """Idefics3ForConditionalGeneration (SmolVLM): tiles + global image per item."""

    architecture = "Idefics3ForConditionalGeneration"

    def __init__(self, model_dir: str, hf_config: dict, tokenizer: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer)
        # lazy: transformers loads only when a multi-modal model is served
        from transformers import AutoImageProcessor
        self.image_seq_len = image_seq_len(hf_config)
        # Every frame must be the tower's image_size: image_seq_len rows per frame
        # assume it (HF's model fails on any other max_image_size too).
        self.frame_side = int((hf_config.get("vision_config") or {}).get("image_size", 224))
        declared = _processor_config(model_dir).get("image_seq_len")
        if declared is not None and int(declared) != self.image_seq_len:
            raise ValueError(f"processor_config.json image_seq_len {declared} differs from "
                             f"the model's {self.image_seq_len} rows per frame")
        vocab = tokenizer.get_vocab()
        missing = [t for t in (IMAGE_TOKEN, FAKE_TOKEN) if t not in vocab]
        if missing:
            raise ValueError(f"{self.architecture}: the tokenizer lacks {', '.join(missing)}")
        token = int(hf_config.get("image_token_id", vocab[IMAGE_TOKEN]))
        if token != vocab[IMAGE_TOKEN]:
            raise ValueError(f"config.json image_token_id {token} is not the tokenizer's "
                             f"{IMAGE_TOKEN} ({vocab[IMAGE_TOKEN]})")
        self.placeholder_token_ids = {IMAGE: token}
        # backend="pil": transformers' PIL image processor (no torchvision needed).
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")

    def process_image(self, image: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        import torch  # lazy: importing this module costs no torch
        out = self.image_processor(images=[image], return_tensors="pt",
                                   return_row_col_info=True, **kwargs)
        pixels = out["pixel_values"][0]  # [frames, 3, S, S]
        if tuple(pixels.shape[-2:]) != (self.frame_side, self.frame_side):
            raise ValueError(f"{self.architecture} takes frames of {self.frame_side}x"
                             f"{self.frame_side} (the vision model's image_size); the image "
                             f"processor made {tuple(pixels.shape[-2:])}: check "
                             "max_image_size in mm_processor_kwargs")
        mask = out.get("pixel_attention_mask")
        if mask is not None and not bool(mask[0].all()):
            # One item's frames are all the tile size; padding would only come from a
            # batch of several items, which this processor never builds.
            raise ValueError(f"{self.architecture}: an image's frames were padded")
        grid = torch.tensor([int(out["rows"][0][0]), int(out["cols"][0][0])], dtype=torch.int64)
        if int(grid[0] * grid[1]) + 1 != pixels.shape[0]:  # tiles + the global image
            raise ValueError(f"{self.architecture}: {pixels.shape[0]} frames for a "
                             f"{int(grid[0])}x{int(grid[1])} tile grid")
        return {"pixel_values": pixels, "image_grid": grid}

    def num_embeds(self, data: Mapping[str, Any]) -> int:
        return int(data["pixel_values"].shape[0]) * self.image_seq_len

    def placeholder_run(self, modality: str, data: Mapping[str, Any]) -> list[int]:
        """HF's `replace_image_token` text for the item, as token ids."""
        rows, cols = (int(x) for x in data["image_grid"])
        text = ""
        for r in range(rows):
            for c in range(cols):
                text += f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{IMAGE_TOKEN}"
            text += "\n"
        if rows:
            text += "\n"
        text += f"{FAKE_TOKEN}{GLOBAL_TOKEN}{IMAGE_TOKEN}{FAKE_TOKEN}"
        image_id = self.placeholder_token_ids[IMAGE]
        run: list[int] = []
        for t in self.tokenizer.encode(text, add_special_tokens=False):
            run.extend([t] * self.image_seq_len if t == image_id else [t])
        return run

    def embeds_data(self, embeds: Any) -> dict[str, Any]:
        raise ValueError(f"{self.architecture} does not take image_embeds: its placeholder "
                         "run depends on the image's tile grid; send the image itself")


def _processor_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "processor_config.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
