"""`pagoda bench mm-processor` runs the library's process_prompt and reports throughput;
with the cache on and repeated images, every prompt after the first is a cache hit."""

from __future__ import annotations

import json

from pagoda.services.cli.main import build_parser


def run(capsys, *flags) -> dict:
    args = build_parser().parse_args(["bench", "mm-processor", *flags])
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_it_reports_throughput_and_cache_hits(capsys, llava_clip_dir):
    cold = run(capsys, "--model", llava_clip_dir, "--num-prompts", "4", "--num-warmups", "1",
               "--image-size", "40x60", "--images-per-prompt", "2")
    assert cold["images_per_s"] > 0 and cold["cache_queries"] == 0
    assert cold["images_per_s"] == round(2 * cold["prompts_per_s"], 2) or \
        abs(cold["images_per_s"] - 2 * cold["prompts_per_s"]) < 0.05
    warm = run(capsys, "--model", llava_clip_dir, "--num-prompts", "4", "--num-warmups", "1",
               "--image-size", "40x60", "--mm-processor-cache-gb", "0.1", "--repeat-images")
    assert (warm["cache_hits"], warm["cache_queries"]) == (4, 5)
