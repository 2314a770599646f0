"""Pooling requests in the scheduler, with a scripted worker: a prefill and nothing else.

A pooling engine runs without chunked prefill (EngineArgs turns it off), so a pooling
request is admitted only with its whole prompt, sent to the worker with its pooling
params, and finished in the step that ran it, with the worker's vector; its blocks
are free right after.
"""

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, FinishReason, ModelRunnerOutput
from pagoda.pooling_params import PREFILL_ONLY, PoolingParams


def make_scheduler(budget=16, num_blocks=64, caching=True):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_model_len=64, enable_chunked_prefill=False),
                     CacheConfig(block_size=4, enable_prefix_caching=caching), num_blocks)


def add(s, rid, n_prompt, first_token=1):
    s.add_request(EngineCoreRequest(rid, list(range(first_token, first_token + n_prompt)),
                                    PREFILL_ONLY, pooling_params=PoolingParams(task="embed")))


def step(s):
    """Schedule, then 'pool' [request length, first token] for every pooling request."""
    so = s.schedule()
    pooled = {rid: [float(s.requests[rid].num_tokens), float(s.requests[rid].all_token_ids[0])]
              for rid in so.num_scheduled_tokens}
    runner = ModelRunnerOutput(list(pooled), [[] for _ in pooled], pooler_output=pooled)
    return so, s.update_from_output(so, runner)


def test_a_pooling_request_finishes_in_the_step_that_ran_its_prompt():
    s = make_scheduler()
    add(s, "a", 10)
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 10}
    new = so.scheduled_new_reqs[0]
    assert new.pooling_params.task == "embed" and new.num_computed_tokens == 0
    assert [(o.request_id, o.finish_reason, o.pooling_output, o.new_token_ids) for o in outs] \
        == [("a", FinishReason.STOP, [10.0, 1.0], [])]
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.pool.num_free_blocks == 64
    assert step(s)[0].finished_req_ids == {"a"}  # the worker forgets it next step


def test_prompts_are_never_split_across_steps():
    s = make_scheduler(budget=16)
    add(s, "a", 10)
    add(s, "b", 10, first_token=20)
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"a": 10}  # b does not fit the rest of the budget
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"b": 10} and outs[0].pooling_output == [10.0, 20.0]


def test_an_aborted_pooling_request_reports_once_without_a_vector():
    s = make_scheduler()
    add(s, "a", 6)
    s.finish_requests(["a"], FinishReason.ABORT)
    so, outs = step(s)
    assert so.total_num_scheduled_tokens == 0
    assert [(o.finish_reason, o.pooling_output) for o in outs] == [(FinishReason.ABORT, None)]


def test_a_repeated_prompt_hits_the_prefix_cache_but_still_runs_its_last_token():
    s = make_scheduler()
    add(s, "a", 10)
    step(s)
    add(s, "b", 10)
    so, outs = step(s)
    assert so.num_scheduled_tokens == {"b": 2}  # two full blocks were cached
    assert outs[0].num_cached_tokens == 8 and outs[0].finished
