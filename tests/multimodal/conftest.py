"""Tiny random LLaVA checkpoints (CLIP and SigLIP towers), built once per session."""

from __future__ import annotations

import pytest

from llava_cases import layout_copy, save_tiny_llava


@pytest.fixture(scope="session")
def llava_clip_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_llava(tmp_path_factory.mktemp("llava_clip"), smollm2_tokenizer, "clip")


@pytest.fixture(scope="session")
def llava_siglip_dir(tmp_path_factory, smollm2_tokenizer) -> str:
    return save_tiny_llava(tmp_path_factory.mktemp("llava_siglip"), smollm2_tokenizer, "siglip",
                           feature_layer=-1)


@pytest.fixture(scope="session")
def llava_clip_layouts(tmp_path_factory, llava_clip_dir) -> dict[str, str]:
    """The CLIP checkpoint under both layouts' names."""
    return {layout: layout_copy(llava_clip_dir, tmp_path_factory.mktemp(f"llava_{layout}"), layout)
            for layout in ("new", "old")}
