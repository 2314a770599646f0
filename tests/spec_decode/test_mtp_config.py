"""`{"method": "mtp"}` parsing (vLLM's rules): `deepseek_mtp` is read as `mtp`, the number
of drafts may be left to the checkpoint, a draft model may not be named, and the drafts
come from the worker (the scheduler allocates their lookahead slots)."""

from __future__ import annotations

import pytest

from pagoda.spec_decode.config import SpeculativeConfig
from pagoda.spec_decode.scheduler_hook import DraftTokens


def test_mtp_is_parsed_as_vllm_does():
    config = SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 2})
    assert (config.method, config.num_speculative_tokens) == ("mtp", 2)
    assert config.uses_mtp and config.drafts_on_worker and not config.uses_draft_model
    assert SpeculativeConfig.parse('{"method": "mtp"}').num_speculative_tokens == 0  # filled later
    hook = DraftTokens(config)
    assert hook.proposer is None and hook.num_lookahead_tokens == 2
    with pytest.raises(ValueError, match='"model" names a draft model; the mtp method'):
        SpeculativeConfig.parse({"method": "mtp", "model": "x", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 0})
