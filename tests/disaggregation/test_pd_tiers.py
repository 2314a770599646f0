"""Prefill/decode disaggregation with KV tiers on both sides (issue 31), real processes:
`pagoda serve --prefill-replicas 1 --decode-replicas 1` where each replica has a
16-block device pool, a 4-slot host tier and a disk tier below it.

    prefill replica: revisited prefixes onload from its tiers, the rest is computed,
                     the whole prompt leased ─► decode replica pulls it
    decode replica:  pulled blocks evicted into its own tiers; a request it prefills
                     itself (the P/D fallback) onloads them; a request pulling a short
                     leased prefix onloads the rest of the prompt from its own tiers

Every answer equals the offline float32 engine's (a pool that never evicts), every
onload passes its checks, and nothing stays leased or referenced at the end.
"""

from __future__ import annotations

import pytest
from pd_cluster import generate, metric, role_address, start_pd, usage
from pd_tiers import (FAILED, HITS, MOVED, complete, lease_prefix, offline_answers,
                      prompt_sets, replica_metric, request, tier_flags, tokens)
from serve_cluster import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.extended]  # a P/D cluster: ~90 s on 2 cores


def prompts():
    return prompt_sets()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    first, again = prompts()
    return offline_answers(tiny_llama_dir, first + again)


@pytest.fixture(scope="module")
def pd(tiny_llama_dir, redis_server, tmp_path_factory):
    serve = start_pd(tiny_llama_dir, redis_server.url,
                     *tier_flags(tmp_path_factory.mktemp("kv-disk"), host_slots=4))
    yield serve
    serve.stop()


def tier_hits(serve, role: str, **labels) -> float:
    """Blocks the replica of `role` onloaded from its tiers (`tier="cpu"|"disk"`)."""
    return replica_metric(serve, role, HITS, **labels)


def test_pd_with_tiers_on_both_sides_answers_as_offline(pd, reference):
    first, again = prompts()
    prefill = role_address(pd, "scheduler", "kv_producer")
    decode = role_address(pd, "scheduler", "kv_consumer")

    # Through the gateway, one at a time: every prompt is prefilled on the prefill
    # replica and pulled by the decode replica; each evicts the earlier prefixes on
    # both sides, so the revisits' prefixes come from the prefill replica's tiers.
    producer = "kv_producer"
    moved, hits = metric(pd, MOVED), tier_hits(pd, producer)
    disk = tier_hits(pd, producer, tier="disk")
    for prompt in first + again:
        assert complete(pd, prompt) == reference[tuple(prompt)]
    assert wait_until(lambda: metric(pd, MOVED) - moved >= len(first + again) * 5, 30)
    assert wait_until(lambda: tier_hits(pd, producer) - hits >= 4 * 4, 10), \
        tier_hits(pd, producer) - hits
    assert tier_hits(pd, producer, tier="disk") > disk  # the oldest prefixes: from disk

    # Straight to the decode replica with no transfer (a P/D fallback prefills there):
    # the pulled blocks it evicted come back from its own tiers (all but the last
    # prompt's prefix, which its device may still hold).
    consumer = "kv_consumer"
    hits = tier_hits(pd, consumer)
    for i, prompt in enumerate(first):
        assert tokens(generate(decode, request(f"local-{i}", prompt))) == \
            reference[tuple(prompt)]
    assert wait_until(lambda: tier_hits(pd, consumer) - hits >= 3 * 4, 10), \
        tier_hits(pd, consumer) - hits

    # A 2-block prefix leased at the prefill replica and pulled, the rest of the
    # prompt onloaded from the decode replica's own tiers, then computed.
    for i, prompt in enumerate(again):
        complete(pd, prompt)  # the prefill replica holds it on its device again
        for j in range(3):  # other prompts evict it on the decode side, into its tiers
            generate(decode, request(f"evict-{i}-{j}", first[(i + j + 1) % 4]))
        params = lease_prefix(prefill, prompt, 2)
        hits, moved = tier_hits(pd, consumer), metric(pd, MOVED)
        got = tokens(generate(decode, request(f"pulled-{i}", prompt, params)))
        assert got == reference[tuple(prompt)]
        assert wait_until(lambda: metric(pd, MOVED) > moved, 10)
        assert wait_until(lambda: tier_hits(pd, consumer) > hits, 10)

    assert metric(pd, FAILED) == 0
    state = lambda: (usage(prefill), usage(decode))  # noqa: E731
    assert wait_until(lambda: state() == (0, 0), 30), state()
