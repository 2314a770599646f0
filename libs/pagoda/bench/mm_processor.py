"""`pagoda bench mm-processor`: multi-modal preprocessing throughput (vLLM's
`bench mm-processor`).

Runs the library's `process_prompt` (the function the tokenizer service and the offline
LLM both call: tokenize, the model's HF image processor per image, placeholder
expansion) over `--num-prompts` prompts, each with `--images-per-prompt` random images
of `--image-size` HEIGHTxWIDTH, after `--num-warmups` untimed ones. Prints JSON:
prompts/s, images/s, and the mean/median/p99 milliseconds per prompt; with
`--mm-processor-cache-gb` above 0 and `--repeat-images`, every prompt reuses the first
prompt's images, which measures the processor cache's hits instead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagoda.bench.stats import percentile


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("mm-processor", help="Multi-modal preprocessing throughput.",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="A multi-modal model directory (or hub id already cached).")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--num-warmups", type=int, default=3)
    parser.add_argument("--images-per-prompt", type=int, default=1)
    parser.add_argument("--image-size", default="512x512", metavar="HxW")
    parser.add_argument("--mm-processor-cache-gb", type=float, default=0.0,
                        help="The processor cache (0, the default here: every image "
                             "processed).")
    parser.add_argument("--repeat-images", action="store_true",
                        help="Every prompt reuses the same images (cache hits).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="Write the results to this file.")
    parser.set_defaults(func=run)
    return parser


def _images(rng: random.Random, count: int, height: int, width: int) -> list:
    from PIL import Image  # lazy: the CLI parses flags without Pillow
    return [Image.frombytes("RGB", (width, height), rng.randbytes(height * width * 3))
            for _ in range(count)]


def run(args: argparse.Namespace) -> int:
    # lazy: the processor brings transformers and torch; the CLI imports this for its flags
    from pagoda.model.loader import resolve_model_path
    from pagoda.multimodal.processing import (ProcessorCache, load_mm_processor,
                                              process_prompt)

    path = resolve_model_path(args.model, None, None, weights=False)
    processor = load_mm_processor(path)
    if processor is None:
        raise SystemExit(f"pagoda bench mm-processor: {args.model} takes no images")
    height, width = (int(v) for v in args.image_size.lower().split("x"))
    placeholder = processor.tokenizer.convert_ids_to_tokens(processor.placeholder_token_ids["image"])
    prompt = "USER: " + placeholder * args.images_per_prompt + "\nDescribe. ASSISTANT:"
    cache = ProcessorCache.from_gb(args.mm_processor_cache_gb)
    rng = random.Random(args.seed)
    first = _images(rng, args.images_per_prompt, height, width)
    total = args.num_warmups + args.num_prompts
    seconds = []
    for i in range(total):
        images = first if args.repeat_images or i == 0 else _images(
            rng, args.images_per_prompt, height, width)
        start = time.perf_counter()
        process_prompt(processor, prompt, {"image": images}, cache=cache)
        if i >= args.num_warmups:
            seconds.append(time.perf_counter() - start)
    ms = [s * 1000 for s in seconds]
    wall = sum(seconds)
    result = {
        "model": args.model, "architecture": processor.architecture,
        "num_prompts": args.num_prompts, "images_per_prompt": args.images_per_prompt,
        "image_size": args.image_size, "mm_processor_cache_gb": args.mm_processor_cache_gb,
        "repeat_images": args.repeat_images,
        "prompts_per_s": round(args.num_prompts / wall, 2),
        "images_per_s": round(args.num_prompts * args.images_per_prompt / wall, 2),
        "mean_ms": round(statistics.fmean(ms), 3), "median_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "cache_hits": cache.hits if cache else 0, "cache_queries": cache.queries if cache else 0,
    }
    print(json.dumps(result), flush=True)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0
