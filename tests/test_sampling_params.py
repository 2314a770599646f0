"""SamplingParams: vLLM's defaults, and errors that name the bad field."""

import pytest

from pagoda import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.skip_special_tokens
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=-1).top_k == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
