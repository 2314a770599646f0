"""--prefix-caching-hash-algo: vLLM's sha256 and sha256_cbor, recomputed here from
their definitions (vLLM's `hash_block_tokens` over `(parent, tuple(tokens),
extra_keys)`, the first parent being NONE_HASH = hash_fn(seed string)); Pagoda's
own default is unchanged; vLLM's xxhash variants are refused by name."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from pagoda.core.block_hash import check_hash_algo, hash_request_tokens, request_keys
from pagoda.engine.arg_utils import EngineArgs

TOKENS = list(range(300, 311))  # 2 full blocks of 4 + 3


def vllm_chain(fn, seed: str, tokens: list[int], extra=None) -> list[bytes]:
    parent, out = fn(seed), []
    for i in range(0, len(tokens) - 3, 4):
        parent = fn((parent, tuple(tokens[i:i + 4]), extra))
        out.append(parent)
    return out


def pickle_sha256(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def test_sha256_is_vllms_pickle_hash():
    assert hash_request_tokens(TOKENS, 4, "42", algo="sha256") == \
        vllm_chain(pickle_sha256, "42", TOKENS)
    salted = hash_request_tokens(TOKENS, 4, "42", request_keys("s"), algo="sha256")
    assert salted == vllm_chain(pickle_sha256, "42", TOKENS, ("s",))


def test_the_algorithms_and_seeds_give_different_hashes_and_the_default_is_unchanged():
    default = hash_request_tokens(TOKENS, 4, "42")
    # Pagoda's own scheme, as before this flag existed.
    root = hashlib.sha256(b"pagoda-root:42").digest()
    first = hashlib.sha256(root + b"".join(t.to_bytes(8, "little") for t in TOKENS[:4]))
    assert default[0] == first.digest()
    chains = [default] + [hash_request_tokens(TOKENS, 4, "42", algo=a)
                          for a in ("sha256", "sha256_cbor")]
    assert len({tuple(c) for c in chains}) == 3
    assert hash_request_tokens(TOKENS, 4, "43", algo="sha256_cbor") != chains[2]
    # A growing sequence extends its chain the same way.
    grown = hash_request_tokens(TOKENS + [1], 4, "42", start_hashes=chains[2][:1],
                                algo="sha256_cbor")
    assert grown[:2] == chains[2] and len(grown) == 3


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor", "md5"])
def test_an_algorithm_pagoda_does_not_implement_is_refused(algo):
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of pagoda, "
                                         "sha256, sha256_cbor") as err:
        check_hash_algo(algo)
    assert ("xxhash variants are not implemented" in str(err.value)) == algo.startswith("xx")


def test_the_flag_reaches_the_cache_config():
    parser = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser())
    args = parser.parse_args(["--model", "m", "--prefix-caching-hash-algo", "sha256_cbor"])
    assert args.prefix_caching_hash_algo == "sha256_cbor"
    assert EngineArgs().prefix_caching_hash_algo == "pagoda"
