"""Two engine steps' model inputs for sharded-model tests: a prefill of two requests,
then a decode of both (block tables of 4-token blocks, as the worker builds them)."""

from __future__ import annotations


def two_steps(last_prompt_token: int = 2000) -> list:
    """[(input_ids, positions, metadata)] for the prefill step and the decode step;
    `last_prompt_token`: request a's last prompt token (under the model's vocabulary)."""
    from pagoda.messages import NewRequestData
    from pagoda.sampling_params import SamplingParams
    from pagoda.worker.batch_state import CachedRequestState
    from pagoda.worker.input_builder import build_model_inputs

    states = {req_id: CachedRequestState.from_new(
        NewRequestData(req_id, prompt, [], SamplingParams(), blocks, 0), None)
        for req_id, prompt, blocks in (("a", [5, 9, 300, 41, 7, 8, last_prompt_token], [3, 1]),
                                       ("b", [11, 12, 13, 14], [0, 2]))}
    steps = []
    for num_scheduled in ({"a": 7, "b": 4}, {"a": 1, "b": 1}):
        inputs = build_model_inputs(states, num_scheduled, 4, "cpu")
        steps.append((inputs.input_ids, inputs.positions, inputs.attn_metadata))
        for req_id, n in num_scheduled.items():
            states[req_id].num_computed_tokens += n
            states[req_id].append_token(17 + n)
    return steps
