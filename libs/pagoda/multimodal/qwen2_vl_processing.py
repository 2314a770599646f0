"""Qwen2-VL's and Qwen2.5-VL's preprocessing (transformers' `Qwen2VLProcessor`, per item): the PIL image
processor resizes each image to multiples of patch * merge within its pixel bounds
(dynamic resolution), and the image's one `<|image_pad|>` (inside the template's
`<|vision_start|>...<|vision_end|>`) becomes t * h * w / merge**2 placeholders."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagoda.multimodal.inputs import IMAGE
from pagoda.multimodal.processing import MultiModalProcessor


class Qwen2VLProcessor(MultiModalProcessor):
    architecture = "Qwen2VLForConditionalGeneration"

    def __init__(self, model_dir: str, hf_config: dict, tokenizer: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer)
        self.architecture = (hf_config.get("architectures") or [self.architecture])[0]
        # lazy: transformers loads only when a multi-modal model is served
        from transformers import AutoImageProcessor
        self.merge_size = int((hf_config.get("vision_config") or {}).get("spatial_merge_size", 2))
        self.placeholder_token_ids = {IMAGE: int(hf_config.get("image_token_id", 151655))}
        self.image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")

    def process_image(self, image: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"][0]}

    def num_embeds(self, data: Mapping[str, Any]) -> int:
        return int(data["image_grid_thw"].prod()) // self.merge_size ** 2

    def embeds_data(self, embeds: Any) -> dict[str, Any]:
        raise ValueError(f"{self.architecture} takes images as pixels only: image_embeds "
                         "need their image_grid_thw, which Pagoda does not accept yet")
