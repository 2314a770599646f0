"""Granite-4.0-H (hybrid) and the KV roles of a scheduler replica: P/D hands over KV
blocks without the Mamba2 state, so a prefill or decode replica is refused at start-up
naming the architecture (not the prefix cache, which the family turns off itself); a
colocated replica is left as it was (it serves without transfers, and its migrated
requests recompute their context: test_granitemoehybrid_migration.py)."""

from __future__ import annotations

import pytest

from arch_parity import save_tiny_checkpoint
from pagoda.engine.arg_utils import EngineArgs
from pagoda.kv_transfer.config import KVTransferConfig
from pagoda.services.scheduler.kv_role import refuse_kv_transfer_for_hybrid
from test_granitemoehybrid import granite_hybrid_config


@pytest.fixture(scope="module")
def hybrid_config(tmp_path_factory, smollm2_tokenizer):
    path = save_tiny_checkpoint(tmp_path_factory.mktemp("granite_hybrid"),
                                granite_hybrid_config(), smollm2_tokenizer)
    return EngineArgs(model=path, dtype="float32").create_engine_config()


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_a_hybrid_prefill_or_decode_replica_is_refused_by_name(hybrid_config, role):
    config = KVTransferConfig(kv_connector="PagodaConnector", kv_role=role)
    with pytest.raises(SystemExit, match="GraniteMoeHybridForCausalLM is a hybrid model with "
                                         f"Mamba2 layers: prefill/decode disaggregation "
                                         f"\\(kv_role {role}"):
        refuse_kv_transfer_for_hybrid(config, hybrid_config)


def test_a_colocated_hybrid_replica_and_a_plain_model_pass(hybrid_config, tiny_llama_dir):
    refuse_kv_transfer_for_hybrid(KVTransferConfig(kv_connector="PagodaConnector",
                                                   kv_role="kv_both"), hybrid_config)
    plain = EngineArgs(model=tiny_llama_dir, dtype="float32").create_engine_config()
    for role in ("kv_producer", "kv_consumer"):
        refuse_kv_transfer_for_hybrid(KVTransferConfig(kv_connector="PagodaConnector",
                                                       kv_role=role), plain)
