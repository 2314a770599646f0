"""The scheduler's LoRA gate with a scripted model (no adapters loaded): the running
requests use at most max_loras adapters; a request with one more waits, without
holding up the requests behind it, until an adapter's last request finishes."""

from __future__ import annotations

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.scheduler import Scheduler
from pagoda.lora.request import LoRARequest
from pagoda.messages import EngineCoreRequest, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams


def add(s: Scheduler, rid: str, adapter: int | None, max_tokens: int) -> None:
    lora = LoRARequest(f"a{adapter}", adapter, f"/adapters/{adapter}") if adapter else None
    s.add_request(EngineCoreRequest(rid, [1, 2, 3, 4, 5],
                                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), [0],
                                    lora_request=lora))


def step(s: Scheduler) -> list[str]:
    """One step sampling token 7 for every request; the ids of the requests admitted."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    s.update_from_output(so, ModelRunnerOutput(ids, [[7] for _ in ids]))
    return [d.req_id for d in so.scheduled_new_reqs]


def test_a_third_adapter_waits_while_two_run_then_runs():
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                                  max_loras=2),
                  CacheConfig(block_size=4, enable_prefix_caching=False), 64)
    add(s, "one", 1, max_tokens=2)
    add(s, "two", 2, max_tokens=8)
    add(s, "three", 3, max_tokens=2)  # a third adapter: waits
    add(s, "base", None, max_tokens=8)  # behind it, no adapter: goes ahead
    add(s, "one-again", 1, max_tokens=2)  # behind it, a running adapter: goes ahead
    assert step(s) == ["one", "two", "base", "one-again"]
    stats = s.get_stats()
    assert stats.running_lora_adapters == {"a1": 2, "a2": 1}
    assert stats.waiting_lora_adapters == {"a3": 1}
    assert step(s) == []  # both requests of a1 finish with this step's token
    assert step(s) == ["three"]
    assert s.get_stats().running_lora_adapters == {"a2": 1, "a3": 1}
