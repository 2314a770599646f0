"""`pagoda bench serve --dataset-name random-mm`: vLLM's bucket config, seeded images,
the same-image mode, and the chat body the images travel in."""

from __future__ import annotations

import argparse
import base64
import io

import pytest
from PIL import Image

from pagoda.services.bench import random_mm
from pagoda.services.bench.datasets import BenchRequest


def args(**kw) -> argparse.Namespace:
    base = dict(random_mm_base_items_per_request=2,
                random_mm_bucket_config="{(20, 30, 1): 1, (8, 8, 1): 3}",
                random_mm_same_image=False)
    base.update(kw)
    return argparse.Namespace(**base)


def size(url: str) -> tuple[int, int]:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).size


def test_buckets_parse_in_vllms_form_and_normalise():
    assert random_mm.parse_buckets("{(20, 30, 1): 1, (8, 8, 1): 3}") == [((20, 30), 0.25),
                                                                          ((8, 8), 0.75)]
    for bad in ("{(8, 8, 2): 1.0}", "[1, 2]", "{(8, 8, 1): -1}", "nonsense"):
        with pytest.raises(SystemExit, match="random-mm-bucket-config"):
            random_mm.parse_buckets(bad)


def test_images_are_seeded_sized_from_the_buckets_and_distinct():
    urls = random_mm.image_urls(args(), 6, seed=5)
    assert urls == random_mm.image_urls(args(), 6, seed=5)
    assert all(len(u) == 2 for u in urls)
    assert {size(u) for r in urls for u in r} <= {(30, 20), (8, 8)}  # PIL: (width, height)
    assert len({u for r in urls for u in r}) == 12


def test_same_image_mode_sends_one_set_to_every_request():
    urls = random_mm.image_urls(args(random_mm_same_image=True), 4, seed=5)
    assert all(r == urls[0] for r in urls) and urls[0][0] != urls[0][1]


def test_the_chat_body_puts_the_images_before_the_text():
    body = random_mm.with_images({"model": "m", "messages": []},
                                 BenchRequest("hello", [1], 4), ["data:a", "data:b"])
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:a"}},
        {"type": "image_url", "image_url": {"url": "data:b"}},
        {"type": "text", "text": "hello"}]}]
