"""The scheduler's draft tokens (n-gram speculation) with a scripted worker: a decode's
drafts ride in its next step, the rejected ones are rolled back so its computed tokens
catch up with its known tokens again, and the acceptance is counted."""

from __future__ import annotations

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.config import SpeculativeConfig


def test_rejected_drafts_are_rolled_back_and_the_acceptance_counted():
    spec = SpeculativeConfig(3, prompt_lookup_min=1, prompt_lookup_max=2)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                  speculative_config=spec),
                  CacheConfig(block_size=4, enable_prefix_caching=False), 64)
    s.add_request(EngineCoreRequest("a", [1, 2, 3, 1, 2, 3, 1, 2],
                                    SamplingParams(max_tokens=20, ignore_eos=True), [0]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {}  # a prefill takes no drafts
    s.update_from_output(so, ModelRunnerOutput(["a"], [[3]]))

    so = s.schedule()  # "2 3" was last followed by "1 2 3"
    assert so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    assert so.num_scheduled_tokens == {"a": 4}
    outputs = s.update_from_output(so, ModelRunnerOutput(["a"], [[1, 9]]))  # 1 of 3 accepted
    assert outputs[0].new_token_ids == [1, 9]
    request = s.requests["a"]
    assert request.num_computed_tokens == request.num_tokens - 1
    stats = s.get_stats().spec_decoding
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            stats.accepted_per_pos) == (1, 3, 1, [1, 0, 0])
