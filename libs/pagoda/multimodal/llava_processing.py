"""LLaVA's preprocessing (transformers' `LlavaProcessor`, per item): the vision tower's
image processor (CLIP's or SigLIP's, PIL backend) and one `<image>` run per image.

The run length is HF's rule: (H // patch) * (W // patch) patches of the resized image,
plus the CLS position a CLIP tower adds, minus one under the "default" feature select
strategy (which drops the tower's first position).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.multimodal.inputs import IMAGE
from pagoda.multimodal.processing import MultiModalProcessor

# Vision towers whose sequence carries a CLS position before the patches.
_TOWERS_WITH_CLS = {"clip_vision_model": 1, "siglip_vision_model": 0}


class LlavaProcessor(MultiModalProcessor):
    """LlavaForConditionalGeneration: CLIP or SigLIP tower, fixed-size images."""

    architecture = "LlavaForConditionalGeneration"

    def __init__(self, model_dir: str, hf_config: dict, tokenizer: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer)
        # lazy: transformers loads only when a multi-modal model is served
        from transformers import AutoImageProcessor
        vision = hf_config.get("vision_config") or {}
        tower = vision.get("model_type", "clip_vision_model")
        if tower not in _TOWERS_WITH_CLS:
            raise ValueError(f"{self.architecture} with a {tower!r} vision tower is not "
                             f"supported; supported towers: {', '.join(_TOWERS_WITH_CLS)}")
        self.num_additional_tokens = _TOWERS_WITH_CLS[tower]
        self.patch_size = int(vision.get("patch_size", 14))
        self.select_strategy = hf_config.get("vision_feature_select_strategy", "default")
        token = hf_config.get("image_token_index", hf_config.get("image_token_id", 32000))
        self.placeholder_token_ids = {IMAGE: int(token)}
        # backend="pil": transformers' PIL image processors (no torchvision needed).
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")

    def process_image(self, image: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        return {"pixel_values": out["pixel_values"][0]}

    def num_embeds(self, data: Mapping[str, Any]) -> int:
        if "image_embeds" in data:
            return int(data["image_embeds"].shape[0])
        _, height, width = data["pixel_values"].shape
        n = (height // self.patch_size) * (width // self.patch_size) + self.num_additional_tokens
        return n - 1 if self.select_strategy == "default" else n
