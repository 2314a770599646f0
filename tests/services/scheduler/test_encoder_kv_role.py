"""A scheduler whose model is an encoder (no KV cache): it neither fetches a KV layout
nor publishes KV events, and a prefill/decode role is refused at start-up with the
reason (the served path itself: tests/e2e/test_cluster_encoder.py)."""

from __future__ import annotations

import pytest
from pooling_cases import add_sentence_transformers, build_bert

from pagoda.engine.arg_utils import EngineArgs
from pagoda.services.cli.main import build_parser
from pagoda.services.scheduler.kv_role import refuse_kv_transfer_without_kv_cache


@pytest.fixture(scope="module")
def st_bert(tmp_path_factory) -> str:
    return str(add_sentence_transformers(build_bert(tmp_path_factory.mktemp("st")), "mean",
                                         True))


def scheduler_args(model: str, *flags: str):
    return build_parser().parse_args(["scheduler", "--model", model, "--dtype", "float32",
                                      *flags])


def test_an_encoder_replica_publishes_no_kv_events(st_bert):
    args = scheduler_args(st_bert)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.is_encoder and not config.cache.enable_prefix_caching
    refuse_kv_transfer_without_kv_cache(args, config)
    assert args.kv_cache_manager_addr == ""


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer", "kv_both"])
def test_an_encoder_replica_refuses_a_kv_transfer_role(st_bert, role):
    args = scheduler_args(st_bert, "--kv-transfer-config",
                          f'{{"kv_connector": "PagodaConnector", "kv_role": "{role}"}}')
    config = EngineArgs.from_cli_args(args).create_engine_config()
    with pytest.raises(SystemExit, match="encoder and keeps no KV cache"):
        refuse_kv_transfer_without_kv_cache(args, config)


def test_a_decoder_replica_is_left_as_it_was(tiny_llama_dir):
    args = scheduler_args(tiny_llama_dir, "--runner", "pooling")
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert not config.is_encoder
    addr = args.kv_cache_manager_addr
    refuse_kv_transfer_without_kv_cache(args, config)
    assert args.kv_cache_manager_addr == addr
