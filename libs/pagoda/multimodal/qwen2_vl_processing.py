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
        """vLLM's form: {"image_embeds": [rows, text hidden], "image_grid_thw": [3]}, the
        merger's output rows of one image; its grid places the run and its M-RoPE
        positions, so bare embeddings are refused."""
        import torch  # lazy: importing this module costs no torch (flag parsers use it)
        if not isinstance(embeds, Mapping) or "image_grid_thw" not in embeds:
            raise ValueError(f"{self.architecture} takes image_embeds with their "
                             "image_grid_thw: multi_modal_data={'image': {'image_embeds': "
                             "tensor, 'image_grid_thw': tensor}}")
        rows, grid = embeds["image_embeds"], torch.as_tensor(embeds["image_grid_thw"]).long()
        if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or grid.numel() != 3:
            raise ValueError("image_embeds must be [rows, hidden_size] with an "
                             "image_grid_thw of 3 values per image")
        grid = grid.reshape(3)
        expected = int(grid.prod()) // self.merge_size ** 2
        if rows.shape[0] != expected or rows.shape[1] != self.text_hidden_size:
            raise ValueError(f"image_embeds of shape {tuple(rows.shape)} do not fit "
                             f"image_grid_thw {grid.tolist()}: {self.architecture} expects "
                             f"[{expected}, {self.text_hidden_size}]")
        return {"image_embeds": rows, "image_grid_thw": grid}
