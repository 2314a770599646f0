"""vLLM's `random-mm` dataset for `pagoda bench serve`: random text plus random images.

Each request is a chat whose user message holds `--random-mm-base-items-per-request`
images (image_url parts with PNG data: URLs) before its random text. Image sizes are
drawn from `--random-mm-bucket-config` (vLLM's form: a Python-literal dict
`{(height, width, 1): probability, ...}`; the third entry 1 means an image, >1 a video,
which is refused here). `--random-mm-same-image` (Pagoda's own) sends one image in every
request, to compare the encoder and prefix caches' effect (same image repeated) with
distinct images. Pure given the seed.
"""

from __future__ import annotations

import argparse
import ast
import base64
import io
import random
from typing import Any

from pagoda.services.bench.datasets import BenchRequest

DEFAULT_BUCKETS = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"  # vLLM's default


def add_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("random-mm dataset (vLLM's flags)")
    group.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                       help="Images per request.")
    group.add_argument("--random-mm-bucket-config", default=DEFAULT_BUCKETS,
                       help="{(height, width, 1): probability, ...}: image sizes drawn per "
                            "image (videos, a third entry > 1, are not supported).")
    group.add_argument("--random-mm-same-image", action="store_true",
                       help="Pagoda's: one image in every request (encoder and prefix cache "
                            "hits) instead of a new one each time.")


def parse_buckets(text: str) -> list[tuple[tuple[int, int], float]]:
    """[((height, width), probability)], probabilities normalised; SystemExit if bad."""
    try:
        raw = ast.literal_eval(text)
        buckets = [((int(h), int(w)), float(p)) for (h, w, t), p in raw.items() if t == 1]
        if len(buckets) != len(raw) or not buckets or any(p < 0 for _, p in buckets):
            raise ValueError
    except (ValueError, SyntaxError, TypeError, AttributeError):
        raise SystemExit("pagoda bench serve: --random-mm-bucket-config must be like "
                         f"{DEFAULT_BUCKETS} (images only: third entry 1)") from None
    total = sum(p for _, p in buckets)
    return [(size, p / total) for size, p in buckets]


def random_image_url(rng: random.Random, size: tuple[int, int]) -> str:
    """A PNG of random pixels (incompressible: the worst case for bytes on the wire)."""
    from PIL import Image  # lazy: only this dataset needs Pillow
    height, width = size
    pixels = rng.randbytes(height * width * 3)
    buf = io.BytesIO()
    Image.frombytes("RGB", (width, height), pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_urls(args: argparse.Namespace, num: int, seed: int, same: bool | None = None
               ) -> list[list[str]]:
    """The image_url URLs of each of `num` requests (`same`: one set for all; default
    --random-mm-same-image)."""
    rng = random.Random(seed)
    buckets = parse_buckets(args.random_mm_bucket_config)
    sizes, weights = [b[0] for b in buckets], [b[1] for b in buckets]
    per = args.random_mm_base_items_per_request
    if args.random_mm_same_image if same is None else same:
        shared = [random_image_url(rng, rng.choices(sizes, weights)[0]) for _ in range(per)]
        return [list(shared) for _ in range(num)]
    return [[random_image_url(rng, rng.choices(sizes, weights)[0]) for _ in range(per)]
            for _ in range(num)]


def with_images(body: dict[str, Any], request: BenchRequest, urls: list[str]) -> dict[str, Any]:
    """A chat body whose user message is the images, then the request's text."""
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    parts.append({"type": "text", "text": request.prompt})
    return {**body, "messages": [{"role": "user", "content": parts}]}
