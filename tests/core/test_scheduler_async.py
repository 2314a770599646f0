"""Async scheduling's reconciliation rules, with a scripted worker (no model): the next
step is planned before the last one's output is applied (pagoda.engine.async_steps)."""

from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.core.scheduler import Scheduler
from pagoda.messages import EngineCoreRequest, FinishReason, ModelRunnerOutput
from pagoda.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=64, budget=64, block_size=4):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_model_len=256, async_scheduling=True),
                     CacheConfig(block_size=block_size, enable_prefix_caching=False), num_blocks)


def add(s, rid, n_prompt, max_tokens=8, **kw):
    s.add_request(EngineCoreRequest(rid, list(range(1, n_prompt + 1)),
                                    SamplingParams(max_tokens=max_tokens, **kw), [EOS]))


def plan(s):
    """Schedule; also which requests the step samples for (it reaches their end)."""
    before = {rid: r.num_output_placeholders for rid, r in s.requests.items()}
    so = s.schedule()
    samples = [rid for rid in so.num_scheduled_tokens
               if s.requests[rid].num_output_placeholders > before.get(rid, 0)]
    return so, samples


def apply(s, step, tokens=None):
    """The worker's output of a planned step: token 7 (or tokens[rid]) per sampler."""
    so, samples = step
    tokens = tokens or {}
    return s.update_from_output(so, ModelRunnerOutput(
        list(samples), [[tokens.get(rid, 7)] for rid in samples]))


def by_id(outputs):
    return {o.request_id: o for o in outputs}


def test_decode_is_planned_before_the_last_token_is_known():
    s = make_scheduler()
    add(s, "a", 6)
    step1 = plan(s)
    assert step1[0].num_scheduled_tokens == {"a": 6}
    step2 = plan(s)  # step 1 still running: its token is a placeholder
    assert step2[0].num_scheduled_tokens == {"a": 1}
    assert s.requests["a"].num_output_placeholders == 2
    assert by_id(apply(s, step1))["a"].new_token_ids == [7]
    request = s.requests["a"]
    assert request.output_token_ids == [7] and request.num_output_placeholders == 1
    assert plan(s)[0].num_scheduled_tokens == {"a": 1}


def test_max_tokens_reached_in_flight_is_not_planned_again():
    s = make_scheduler()
    add(s, "a", 5, max_tokens=2)
    step1, step2 = plan(s), plan(s)  # prefill (token 1), decode (token 2)
    apply(s, step1)
    step3 = plan(s)  # its second and last token is in flight: no wasted slot
    assert "a" not in step3[0].num_scheduled_tokens
    out = by_id(apply(s, step2))["a"]
    assert out.finish_reason == FinishReason.LENGTH
    assert s.kv_cache_manager.pool.num_free_blocks == 64


def test_eos_at_step_n_discards_the_token_of_step_n_plus_1():
    s = make_scheduler()
    add(s, "a", 5)
    add(s, "b", 5)
    step1, step2 = plan(s), plan(s)
    out = by_id(apply(s, step1, {"a": EOS}))
    assert out["a"].finish_reason == FinishReason.STOP and out["a"].new_token_ids == [EOS]
    step3 = plan(s)
    assert "a" in step3[0].finished_req_ids  # the worker forgets it
    assert "a" not in step3[0].num_scheduled_tokens
    out = by_id(apply(s, step2))  # a's extra token (from the wasted slot) is dropped
    assert "a" not in out and out["b"].new_token_ids == [7]
    assert s.requests["b"].output_token_ids == [7, 7]


def test_abort_with_steps_in_flight_drops_their_tokens():
    s = make_scheduler()
    add(s, "a", 5)
    step1, step2 = plan(s), plan(s)
    s.finish_requests(["a"], FinishReason.ABORT)
    assert [o.finish_reason for o in apply(s, step1)] == [FinishReason.ABORT]
    assert apply(s, step2) == []
    assert "a" in plan(s)[0].finished_req_ids
    assert s.kv_cache_manager.pool.num_free_blocks == 64


def test_reused_id_never_gets_an_older_steps_token():
    s = make_scheduler()
    add(s, "a", 5)
    step1, step2 = plan(s), plan(s)
    s.finish_requests(["a"], FinishReason.ABORT)
    apply(s, step1)
    add(s, "a", 3)  # a new request under the same id, while step 2 still runs
    step3 = plan(s)
    assert step3[0].scheduled_new_reqs[0].req_id == "a"
    assert apply(s, step2, {"a": 99}) == []  # step 2's token was the old request's
    assert s.requests["a"].output_token_ids == []
    assert by_id(apply(s, step3, {"a": 5}))["a"].new_token_ids == [5]


def test_preempted_with_a_step_in_flight_keeps_its_token_and_resumes_with_it():
    # 4 blocks of 4 tokens: a (7 prompt) and b (7 prompt) fill them as they decode.
    s = make_scheduler(num_blocks=4)
    add(s, "a", 7)
    add(s, "b", 7)
    step1 = plan(s)
    assert step1[0].num_scheduled_tokens == {"a": 7, "b": 7}
    step2 = plan(s)  # positions 7 of both: still within their 2 blocks each
    apply(s, step1, {"a": 11, "b": 21})
    step3 = plan(s)  # position 8 needs a third block each: b (the latest) is preempted
    assert "b" in step3[0].preempted_req_ids and step3[0].num_scheduled_tokens == {"a": 1}
    out = by_id(apply(s, step2, {"a": 12, "b": 22}))
    assert out["b"].new_token_ids == [22]  # step 2 ran for b: its token is kept
    b = s.requests["b"]
    assert b.output_token_ids == [21, 22] and b.num_output_placeholders == 0
    apply(s, step3, {"a": EOS})  # a ends: b comes back with every token it has
    step4 = plan(s)
    resumed = step4[0].scheduled_new_reqs[0]
    assert resumed.req_id == "b" and resumed.output_token_ids == [21, 22]
    assert step4[0].num_scheduled_tokens == {"b": 9}


def test_waiting_request_with_a_token_in_flight_is_not_admitted():
    s = make_scheduler()
    add(s, "a", 5)
    plan(s)
    request = s.requests["a"]
    s.running.remove(request)  # as if preempted while its step runs
    s.kv_cache_manager.free(request)
    request.num_computed_tokens = 0
    s.waiting.prepend_request(request)
    assert "a" not in plan(s)[0].num_scheduled_tokens
