"""The scheduler's encoder budget and the block hashes of prompts with images (scripted
model, no torch model)."""

import pytest

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.block_hash import hash_request_tokens, mm_block_keys
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, ModelRunnerOutput
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.sampling_params import SamplingParams

IMG = 99


def make_scheduler(encoder_budget=10, budget=64, num_blocks=64):
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=256,
                                     max_num_encoder_input_tokens=encoder_budget,
                                     encoder_cache_size=encoder_budget),
                     CacheConfig(block_size=4, enable_prefix_caching=True), num_blocks)


def image(offset, length, ident="a" * 64):
    # The scheduler only asks whether an item has its encoder input (media_guard.py).
    return MultiModalFeature("image", ident, offset, length, data={"pixel_values": b"px"})


def prompt_with_images(runs, n=40):
    ids = list(range(1, n + 1))
    for offset, length in runs:
        ids[offset:offset + length] = [IMG] * length
    return ids


def run_step(s):
    so = s.schedule()
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
               for r in so.num_scheduled_tokens]
    s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled))
    return so.num_scheduled_tokens


def test_a_run_that_does_not_fit_the_encoder_budget_waits_for_the_next_step():
    s = make_scheduler(encoder_budget=10)
    features = [image(2, 8, "a" * 64), image(14, 8, "b" * 64)]
    s.add_request(EngineCoreRequest("r", prompt_with_images([(2, 8), (14, 8)]),
                                    SamplingParams(max_tokens=2), mm_features=features))
    # Step 1: the first image (8 rows) starts; the second (8 more > 10) cuts the step
    # at its offset, 14.
    assert run_step(s) == {"r": 14}
    assert run_step(s) == {"r": 26}  # the rest, the second image included
    # Without the budget, the whole prompt would have run in one step.
    s2 = make_scheduler(encoder_budget=16)
    s2.add_request(EngineCoreRequest("r", prompt_with_images([(2, 8), (14, 8)]),
                                     SamplingParams(max_tokens=2), mm_features=features))
    assert run_step(s2) == {"r": 40}


def test_the_budget_is_shared_by_the_requests_of_a_step():
    s = make_scheduler(encoder_budget=10)
    for rid, ident in (("a", "a" * 64), ("b", "b" * 64)):
        s.add_request(EngineCoreRequest(rid, prompt_with_images([(0, 8)], n=12),
                                        SamplingParams(max_tokens=2),
                                        mm_features=[image(0, 8, ident)]))
    assert run_step(s) == {"a": 12}  # b's image would exceed the budget: b waits
    assert "b" in run_step(s)


def test_an_image_larger_than_the_budget_is_refused():
    s = make_scheduler(encoder_budget=4)
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        s.add_request(EngineCoreRequest("r", prompt_with_images([(0, 8)], n=12),
                                        SamplingParams(), mm_features=[image(0, 8)]))


def test_block_hashes_carry_the_images_they_overlap():
    ids = prompt_with_images([(6, 5)], n=16)  # run covers blocks 1 and 2 (4-token blocks)
    one, two = image(6, 5, "1" * 64), image(6, 5, "2" * 64)
    assert mm_block_keys([one], 4, 8) == ("1" * 64,)
    assert mm_block_keys([one], 0, 4) == ()
    for algo in ("pagoda", "sha256", "sha256_cbor"):
        text = hash_request_tokens(ids, 4, "seed", algo=algo)
        h1 = hash_request_tokens(ids, 4, "seed", algo=algo, mm_features=[one])
        h1_again = hash_request_tokens(ids, 4, "seed", algo=algo, mm_features=[one])
        h2 = hash_request_tokens(ids, 4, "seed", algo=algo, mm_features=[two])
        assert h1 == h1_again
        assert h1[0] == h2[0] == text[0]  # before the image: plain text blocks
        assert all(a != b for a, b in zip(h1[1:], h2[1:]))  # from the image on: never shared
        salted = hash_request_tokens(ids, 4, "seed", ("salt",), algo=algo, mm_features=[one])
        assert salted[0] != h1[0] and salted[1] != h1[1]  # the salt still keys every block
