"""`pagoda serve`'s disaggregation flags: what each replica's processes are told, and
the combinations refused before anything starts."""

from __future__ import annotations

import json

import pytest

from pagoda.services.cli.main import build_parser
from pagoda.kv_transfer.config import KVTransferConfig
from pagoda.services.cli.serve_roles import plan_replicas, role_problem
from pagoda.services.common.kv_transfer_args import require_prefix_caching


def parse(*flags: str):
    return build_parser().parse_args(["serve", "some-model", *flags])


def last(flags: list[str], name: str) -> str:
    """The value argparse keeps: the flag's last occurrence."""
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def test_each_pool_gets_its_role_connector_and_tensor_parallel_size():
    args = parse("--prefill-replicas", "1", "--decode-replicas", "2",
                 "--decode-tensor-parallel-size", "2", "--kv-connector", "PagodaDistConnector")
    assert role_problem(args) is None
    plans = plan_replicas(args)
    assert [p.scheduler for p in plans] == ["scheduler-prefill-0", "scheduler-decode-0",
                                            "scheduler-decode-1"]
    roles = [json.loads(last(p.kv_flags, "--kv-transfer-config")) for p in plans]
    assert [r["kv_role"] for r in roles] == ["kv_producer", "kv_consumer", "kv_consumer"]
    assert {r["kv_connector"] for r in roles} == {"PagodaDistConnector"}
    assert "--tensor-parallel-size" not in plans[0].kv_flags  # the shared flag applies
    assert [last(p.kv_flags, "--tensor-parallel-size") for p in plans[1:]] == ["2", "2"]


@pytest.mark.parametrize("flags,message", [
    (("--decode-tensor-parallel-size", "2"), "need --prefill-replicas"),
    (("--prefill-replicas", "1", "--decode-replicas", "1", "--prefill-tensor-parallel-size",
      "0"), "must be >= 1"),
    (("--kv-connector", "PagodaDistConnector"), "applies to --prefill-replicas"),
    (("--prefill-replicas", "1"), "go together"),
    (("--prefill-replicas", "1", "--decode-replicas", "1", "--no-enable-prefix-caching"),
     "needs the prefix cache"),
])
def test_contradictory_flags_are_refused(flags, message):
    assert message in role_problem(parse(*flags))


def test_colocated_replicas_may_run_without_the_prefix_cache():
    assert role_problem(parse("--data-parallel-size", "2", "--no-enable-prefix-caching")) is None


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_replica_in_a_pd_role_refuses_to_start_without_the_prefix_cache(role):
    """What a scheduler started alone (Kubernetes) does with the same combination."""
    with pytest.raises(SystemExit, match="needs the prefix cache"):
        require_prefix_caching(KVTransferConfig(kv_role=role), enable_prefix_caching=False)
    require_prefix_caching(KVTransferConfig(kv_role=role), enable_prefix_caching=True)
    require_prefix_caching(KVTransferConfig(kv_role="kv_both"), enable_prefix_caching=False)


def test_an_unknown_connector_is_refused_by_the_parser():
    with pytest.raises(SystemExit):
        parse("--prefill-replicas", "1", "--decode-replicas", "1", "--kv-connector", "Nixl")
