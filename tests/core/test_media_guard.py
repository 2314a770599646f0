"""The decode side's rule for media items without their encoder input (P/D): their
blocks may be found (imported KV, keyed by the images' identifiers), never computed
(scripted model, no torch model)."""

from pagoda.core.scheduler import Scheduler
from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.messages import EngineCoreRequest, FinishReason, ModelRunnerOutput
from pagoda.multimodal.inputs import MultiModalFeature
from pagoda.sampling_params import SamplingParams

IMG = 99
BLOCK = 4


def make_scheduler():
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=256,
                                     max_num_encoder_input_tokens=16, encoder_cache_size=16),
                     CacheConfig(block_size=BLOCK, enable_prefix_caching=True), 64)


def prompt(n=22, run=(2, 8)):
    ids = list(range(1, n + 1))
    ids[run[0]:run[0] + run[1]] = [IMG] * run[1]
    return ids


def with_pixels(offset=2, length=8, ident="a" * 64):
    return MultiModalFeature("image", ident, offset, length, data={"pixel_values": b"px"})


def run_step(s):
    so = s.schedule()
    sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else []
               for r in so.num_scheduled_tokens]
    outputs = s.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), sampled))
    return so.num_scheduled_tokens, outputs


def finished(outputs):
    return {o.request_id: o.finish_reason for o in outputs if o.finish_reason is not None}


def test_an_item_without_data_whose_run_must_be_computed_is_refused():
    s = make_scheduler()
    s.add_request(EngineCoreRequest("decode", prompt(), SamplingParams(max_tokens=2),
                                    mm_features=[with_pixels().without_data()]))
    s.add_request(EngineCoreRequest("other", prompt(), SamplingParams(max_tokens=2),
                                    mm_features=[with_pixels(ident="b" * 64)]))
    scheduled, outputs = run_step(s)
    # Nothing of it ran (no placeholder embedding stood in for the image); the request
    # behind it was not held up.
    assert "decode" not in scheduled and scheduled["other"] == 22
    failed = s.take_failed()
    assert "without its encoder input" in failed["decode"] and "[2, 10)" in failed["decode"]
    assert finished(outputs)["decode"] == FinishReason.ABORT
    assert "decode" not in s.requests


def test_an_item_without_data_whose_blocks_are_cached_is_never_encoded():
    """The decode side after its import: the prompt's blocks, keyed by the image's
    identifier, are a prefix hit; it computes only the tail after the run."""
    s = make_scheduler()
    s.add_request(EngineCoreRequest("prefill", prompt(), SamplingParams(max_tokens=1),
                                    mm_features=[with_pixels()]))
    assert run_step(s)[0] == {"prefill": 22}
    s.add_request(EngineCoreRequest("decode", prompt(), SamplingParams(max_tokens=2),
                                    mm_features=[with_pixels().without_data()]))
    scheduled, _ = run_step(s)
    assert scheduled == {"decode": 22 - 5 * BLOCK}  # 5 full blocks hit: [0, 20) covers the run
    assert s.take_failed() == {}


def test_another_image_with_the_same_tokens_gets_no_hit_and_is_refused():
    """Equal placeholder tokens of another image never find the first one's blocks, so a
    data-less item is refused rather than computed from them."""
    s = make_scheduler()
    s.add_request(EngineCoreRequest("prefill", prompt(), SamplingParams(max_tokens=1),
                                    mm_features=[with_pixels()]))
    run_step(s)
    s.add_request(EngineCoreRequest("decode", prompt(), SamplingParams(max_tokens=2),
                                    mm_features=[with_pixels(ident="c" * 64).without_data()]))
    scheduled, _ = run_step(s)
    assert "decode" not in scheduled and "decode" in s.take_failed()


def test_a_recompute_after_preemption_that_reaches_the_run_is_refused():
    s = make_scheduler()
    s.add_request(EngineCoreRequest("prefill", prompt(), SamplingParams(max_tokens=1),
                                    mm_features=[with_pixels()]))
    run_step(s)
    s.add_request(EngineCoreRequest("decode", prompt(), SamplingParams(max_tokens=8),
                                    mm_features=[with_pixels().without_data()]))
    run_step(s)
    s._preempt(s.requests["decode"])  # what running out of blocks does
    assert s.kv_cache_manager.reset_prefix_cache()  # and its blocks were evicted since
    scheduled, outputs = run_step(s)
    assert "decode" not in scheduled
    assert "without its encoder input" in s.take_failed()["decode"]
    assert finished(outputs)["decode"] == FinishReason.ABORT
