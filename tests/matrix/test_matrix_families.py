"""The differential matrix on the model families whose cache is not Llama's (issue 30):
DeepSeek-V3's multi-head latent attention caches one latent per token, not keys and
values; Granite-4.0-H (GraniteMoeHybrid) keeps a Mamba2 conv and SSM state per request
beside the attention layer's blocks. Each family's served paths answer the matrix's
request set exactly as the offline float32 engine does on the same weights (the same
token ids, logprobs within 1e-4):
- DeepSeek-V3: plain, 16-token prefill chunks, TP=2, a KV pool small enough to preempt,
  P/D (the latent blocks moved prefill -> decode, both connectors), the prefix pulled
  from another replica and a request migrated off a killed gpu-worker; MTP speculation
  on a near-bigram variant with an MTP layer (drafts from the checkpoint's own head,
  accepted in part);
- Granite-4.0-H: plain, 16-token prefill chunks, a preempting pool (the state is
  rebuilt), n-gram and draft-model speculation (rejected drafts rewound out of the
  state: vLLM's hybrid bug #39273). Seeded requests under speculation are checked as in
  test_matrix: the same tokens twice on that path (rejection sampling draws differently).

- Granite-4.0-H prefix caching: the set sent twice; the second round's hits end at
  block boundaries whose Mamba state the first round saved (state checkpoints);
- Granite-4.0-H migration: replica 1's gpu-worker SIGKILLed, or its scheduler drained
  out of time, mid-stream; the other replica rebuilds each request's Mamba state from
  its whole context (prompt + the tokens streamed so far), from the state checkpoint
  of the prompt it served before, and continues it.

P/D and the prefix pull are not hybrid rows: moving KV blocks without the Mamba state
is refused by name (test_granitemoehybrid.py), as are TP and PP for the family.
`make test-matrix` runs these rows (PAGODA_MATRIX=full).
"""

from __future__ import annotations

import json
import pathlib
import signal
import time

import pytest
import torch
from clusters import DIST_PD, NGRAM, SMALL_POOL_BLOCKS, served, session_keys, spec_flags
from compare import FP32_LOGPROB_TOL
from request_set import REQUESTS
from rows import ROWS, check_row
from served import send_all
from serve_cluster import wait_until
from test_matrix import metric as labelled_metric
from test_matrix import migrate_off_replica_1, run_pd, run_replicas

pytestmark = [pytest.mark.matrix, pytest.mark.matrix_full, pytest.mark.slow]


def _tiny_deepseek_v3(out: pathlib.Path, tokenizer) -> str:
    """A random DeepSeek-V3 with SmolLM2's whole vocabulary (the request set is text):
    MLA with q_lora_rank, a dense first layer, group-limited sigmoid routing with a
    random correction bias, shared experts."""
    from safetensors.torch import load_file, save_file  # lazy: this fixture only
    from transformers import AutoModelForCausalLM, DeepseekV3Config  # lazy: as above

    config = DeepseekV3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
        n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=0, max_position_embeddings=1024,
        tie_word_embeddings=True, initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name in tensors:
        if name.endswith("e_score_correction_bias"):
            tensors[name] = 0.3 * torch.randn(tensors[name].shape, generator=g)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "DeepseekV3ForCausalLM"]
    return str(out)


def _tiny_granite_hybrid(out: pathlib.Path, tokenizer) -> str:
    """A random Granite-4.0-H with SmolLM2's whole vocabulary: Mamba2 layers around one
    attention layer (NoPE, as the released models), MoE with a shared MLP, scan chunks
    of 8 tokens (every prompt spans several). Tied embeddings, a large embedding and a
    small residual multiplier make its greedy answers run into repeats, so n-gram drafts
    are accepted in part (40 of 50 here) and the rest rewound out of the state."""
    from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig  # lazy: fixture

    config = GraniteMoeHybridConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_chunk_size=8,
        position_embedding_type=None, max_position_embeddings=1024,
        embedding_multiplier=4.0, residual_multiplier=0.3, logits_scaling=1.3,
        attention_multiplier=0.2, tie_word_embeddings=True, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        "GraniteMoeHybridForCausalLM"]
    return str(out)


def _with_reference(model: str, **engine):
    """(model dir, its offline fp32 answers, decode)."""
    from reference import reference_answers, reference_llm  # lazy: loads the engine

    llm = reference_llm(model, **engine)
    tokenizer = llm.get_tokenizer()
    answers = reference_answers(llm, REQUESTS)
    del llm
    return model, answers, lambda ids: tokenizer.decode(ids)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, smollm2_tokenizer):
    return _with_reference(_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek_v3"),
                                             smollm2_tokenizer))


@pytest.fixture(scope="module")
def granite_hybrid(tmp_path_factory, smollm2_tokenizer):
    # No prefix cache for the reference: a served hit restoring a wrong state must not
    # meet a reference that restored the same one.
    return _with_reference(_tiny_granite_hybrid(
        tmp_path_factory.mktemp("tiny_granite_hybrid"), smollm2_tokenizer),
        enable_prefix_caching=False)


def metric(serve, name: str) -> float:
    return sum(v for (n, _), v in serve.scrape().items() if n == name)


def record(*rows) -> None:
    """Add the rows to the table, then fail naming every failed path and request."""
    ROWS.extend(rows)
    failures = [line for row in rows for line in row.failures]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("title,flags", [
    ("DeepSeek-V3 (MLA): plain", []),
    ("DeepSeek-V3 (MLA): chunked prefill, 16-token chunks", ["--max-num-batched-tokens", "16"]),
    ("DeepSeek-V3 (MLA): TP=2", ["--tensor-parallel-size", "2",
                                 "--distributed-executor-backend", "mp"]),
])
def test_deepseek_path(deepseek, title, flags):
    model, want, decode = deepseek
    with served(model, *flags) as serve:
        worker = serve.service_args("gpu-worker")
        got = send_all(serve.url, REQUESTS)
    assert all(flag in worker for flag in flags if flag.startswith("--")), worker
    record(check_row(title, want, got, FP32_LOGPROB_TOL, decode))


@pytest.mark.parametrize("connector", ["PagodaConnector", "PagodaDistConnector"])
def test_deepseek_pd(deepseek, connector):
    """1 prefill + 1 decode replica: the decode side pulls the prompt's latent blocks
    (the rows check that blocks moved) and answers as the offline engine."""
    model, want, decode = deepseek
    extra = DIST_PD if connector == "PagodaDistConnector" else []
    record(*run_pd(model, want, decode, f"DeepSeek-V3 (MLA): P/D, {connector}", *extra))


def test_deepseek_prefix_pull_and_migration(deepseek):
    """Replica 1 pulls the latent blocks of replica 0's prefixes; then its gpu-worker is
    killed mid-stream and the requests continue on replica 0."""
    model, want, decode = deepseek
    rows = run_replicas(model, want, decode)
    for row in rows:
        row.path = f"DeepSeek-V3 (MLA): {row.path}"
        row.failures = [f"DeepSeek-V3 (MLA): {line}" for line in row.failures]
    record(*rows)


def test_deepseek_preempting(deepseek):
    """A pool of SMALL_POOL_BLOCKS latent blocks under the whole set at once: requests
    are preempted and recomputed, and still give the reference's answers."""
    record(preempting_row("DeepSeek-V3 (MLA)", *deepseek))


def _tiny_deepseek_v3_mtp(out: pathlib.Path, tokenizer) -> str:
    """The tiny DeepSeek-V3 made near-bigram (attention and MLP outputs scaled by 0.02:
    its next token depends mostly on the current one; an untied random LM head) plus one
    MTP layer that predicts mostly what it will: layer 2's block (scaled likewise), unit
    enorm/hnorm, eh_proj reading mostly the embedding of the token after its position
    ([I | 0.05 R]), the model's final norm; no embed_tokens or shared_head.head (the
    model's embedding and LM head are used). So drafts are accepted in part and the rest rejected."""
    from safetensors.torch import load_file, save_file  # lazy: this fixture only

    _tiny_deepseek_v3(out, tokenizer)
    config = json.loads((out / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    config["tie_word_embeddings"] = False  # tied, a bigram model repeats its last token
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(out / "model.safetensors")
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = 0.02 * tensors[name]
    g = torch.Generator().manual_seed(3)
    tensors["lm_head.weight"] = 0.2 * torch.randn(config["vocab_size"], hidden, generator=g)
    mtp = {name.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): t.clone()
           for name, t in tensors.items() if name.startswith(f"model.layers.{n - 1}.")}
    mtp[f"model.layers.{n}.enorm.weight"] = torch.ones(hidden)
    mtp[f"model.layers.{n}.hnorm.weight"] = torch.ones(hidden)
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.cat(
        [torch.eye(hidden), 0.05 * torch.randn(hidden, hidden, generator=g)], dim=1)
    mtp[f"model.layers.{n}.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    save_file({**tensors, **mtp}, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory, smollm2_tokenizer):
    return _with_reference(_tiny_deepseek_v3_mtp(
        tmp_path_factory.mktemp("tiny_deepseek_v3_mtp"), smollm2_tokenizer))


def test_deepseek_mtp_speculation(deepseek_mtp):
    """MTP drafts (k=2, the one MTP layer reused) verified by the DeepSeek-V3 target:
    greedy requests give the reference's tokens (offline, without speculation); seeded
    ones the same tokens twice; drafts accepted in part."""
    model, want, decode = deepseek_mtp
    with served(model, *spec_flags({"method": "mtp", "num_speculative_tokens": 2})) as serve:
        got = send_all(serve.url, REQUESTS)
        again = send_all(serve.url, [r for r in REQUESTS if r.seeded])
        drafted = metric(serve, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(serve, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafted > 0, "mtp: nothing was drafted"
    assert 0 < accepted < drafted, f"mtp: {accepted}/{drafted} accepted (no partial rewind)"
    record(check_row("DeepSeek-V3 (MLA): MTP speculation", want, got, FP32_LOGPROB_TOL, decode,
                     again=again,
                     notes=f"{accepted:.0f}/{drafted:.0f} draft tokens accepted; seeded: "
                           "same tokens twice on this path"))


def preempting_row(family: str, model, want, decode, blocks: int = SMALL_POOL_BLOCKS,
                   requests=REQUESTS, flags: tuple[str, ...] = ()):
    """The request set (`requests`) sent at once (up to 4 rounds, until one preempts) to
    a pool of `blocks` blocks, served with `flags` besides: one row, failed if any
    round's answers differ."""
    with served(model, "--max-num-batched-tokens", "64", "--num-gpu-blocks-override",
                str(blocks), *flags) as serve:
        before = metric(serve, "vllm:num_preemptions_total")
        rounds = []
        for _ in range(4):  # until one round overlaps enough to preempt
            rounds.append(send_all(serve.url, requests, concurrent=True))
            if wait_until(lambda: metric(serve, "vllm:num_preemptions_total") > before, 2):
                break
        preempted = metric(serve, "vllm:num_preemptions_total") - before
    assert preempted > 0, f"the small KV pool preempted nothing in {len(rounds)} rounds"
    rows = [check_row(f"{family}: KV pool of {blocks} blocks, preempting", want,
                      got, FP32_LOGPROB_TOL, decode,
                      notes=f"{preempted:.0f} preemptions in {len(rounds)} round(s)",
                      requests=requests)
            for got in rounds]
    row = rows[-1]  # one row: a round's failure shows in it
    row.failures = [line for r in rows for line in r.failures]
    for r in rows[:-1]:
        row.cells.update({c: v for c, v in r.cells.items() if v != "ok"})
    return row


# --------------------------------------------------------------- Granite-4.0-H (hybrid)
@pytest.mark.parametrize("title,flags", [
    ("Granite-4.0-H (Mamba2 hybrid): plain", []),
    ("Granite-4.0-H (Mamba2 hybrid): chunked prefill, 16-token chunks",
     ["--max-num-batched-tokens", "16"]),
])
def test_hybrid_path(granite_hybrid, title, flags):
    model, want, decode = granite_hybrid
    with served(model, *flags) as serve:
        worker = serve.service_args("gpu-worker")
        got = send_all(serve.url, REQUESTS)
    assert all(flag in worker for flag in flags if flag.startswith("--")), worker
    record(check_row(title, want, got, FP32_LOGPROB_TOL, decode))


# The hybrid model's requests run through the pool of SMALL_POOL_BLOCKS without running
# it dry (4 rounds at once preempted nothing, served and offline: one attention layer's
# blocks, no prefix caching); 34 does, and the long request (30 blocks with its answer)
# still fits alone.
HYBRID_POOL_BLOCKS = 34


def test_hybrid_preempting(granite_hybrid):
    """Preempted requests free their state slots; re-admitted, the state is rebuilt
    from their tokens: the reference's answers."""
    record(preempting_row("Granite-4.0-H (Mamba2 hybrid)", *granite_hybrid,
                          blocks=HYBRID_POOL_BLOCKS))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_hybrid_speculation(granite_hybrid, tiny_llama_dir, method):
    """n-gram drafts (accepted in part), and a draft model (the matrix's tiny Llama: same
    vocabulary, its own answers, every draft rejected), verified by the hybrid target:
    rejected drafts leave nothing in the Mamba state, so greedy requests give the
    reference's tokens; seeded ones the same tokens twice on this path."""
    model, want, decode = granite_hybrid
    config = NGRAM if method == "ngram" else {"model": tiny_llama_dir,
                                              "num_speculative_tokens": 3}
    with served(model, *spec_flags(config)) as serve:
        got = send_all(serve.url, REQUESTS)
        again = send_all(serve.url, [r for r in REQUESTS if r.seeded])
        drafted = metric(serve, "vllm:spec_decode_num_draft_tokens_total")
        accepted = metric(serve, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafted > 0, f"{method}: nothing was drafted"
    assert accepted < drafted, f"{method}: every draft was accepted (no rewind tested)"
    if method == "ngram":  # the model repeats itself: drafts accepted in part, then rewound
        assert accepted > 0, "n-gram: no draft was accepted (no partial rewind tested)"
    name = "n-gram speculation" if method == "ngram" else "draft-model speculation"
    record(check_row(f"Granite-4.0-H (Mamba2 hybrid): {name}", want, got, FP32_LOGPROB_TOL,
                     decode, again=again,
                     notes=f"{accepted:.0f}/{drafted:.0f} draft tokens accepted; seeded: "
                           "same tokens twice on this path"))


@pytest.mark.parametrize("how", ["kill", "drain"])
def test_hybrid_migration(granite_hybrid, how):
    """Replica 0 serves the request set first (its Mamba state slots are left non-zero);
    then every request streams to replica 1, which goes away after 3 tokens: its
    gpu-worker SIGKILLed, or its scheduler told to stop with a drain too short to finish
    anything (0.05 s), which ends the streams with drain_timeout. The gateway continues
    each request on replica 0, which computes its whole context (prompt + the tokens
    streamed so far) into a zeroed state slot, or from the state checkpoint its earlier
    run of the prompt saved: the reference's tokens, greedy and seeded. --kv-prefix-pull
    is on: a hybrid replica offers no KV layout, so nothing is pulled (the blocks would
    come without the state)."""
    model, want, decode = granite_hybrid
    k = 3
    victim, sig = (("gpu-worker", signal.SIGKILL) if how == "kill"
                   else ("scheduler", signal.SIGTERM))
    with served(model, "--data-parallel-size", "2", "--router", "session", "--kv-prefix-pull",
                "--kv-prefix-pull-min-blocks", "2", "--drain-timeout", "0.05") as serve:
        keys = session_keys(serve)
        warm = send_all(serve.url, REQUESTS, headers={"X-Session-Id": keys[0]})
        time.sleep(2)  # as in run_replicas: an index that had blocks would know them now
        migrated, moved = migrate_off_replica_1(serve, keys[1], k, victim, sig)
        pulls = labelled_metric(serve, "pagoda_gateway_kv_prefix_pulls_total",
                                result="leased")
        by_reason = {dict(labels)["reason"]: v for (n, labels), v in serve.scrape().items()
                     if n == "pagoda_gateway_migrations_total" and v}
    assert pulls == 0, f"{pulls} prefix pulls leased for a hybrid model"
    if how == "drain":
        assert by_reason.get("drain_timeout", 0) > 0, by_reason
    what = (f"gpu-worker SIGKILLed after {k} tokens" if how == "kill"
            else f"scheduler drained out of time (0.05 s) after {k} tokens")
    record(check_row("Granite-4.0-H (Mamba2 hybrid): replica 0, before the migration", want,
                     warm, FP32_LOGPROB_TOL, decode),
           check_row(f"Granite-4.0-H (Mamba2 hybrid): {what}", want, migrated,
                     FP32_LOGPROB_TOL, decode,
                     notes=f"{moved:.0f} requests migrated ({by_reason}); state rebuilt "
                           "from prompt + streamed tokens, or from replica 0's checkpoint"))


def test_hybrid_prefix_cache(granite_hybrid):
    """The request set twice on one replica: round 2 starts from prefix hits, each
    ending at a block whose Mamba state round 1 saved, and answers as the reference
    (computed without a prefix cache)."""
    model, want, decode = granite_hybrid
    with served(model) as serve:
        first = send_all(serve.url, REQUESTS)
        before = metric(serve, "vllm:prefix_cache_hits_total")
        again = send_all(serve.url, REQUESTS)
        hits = metric(serve, "vllm:prefix_cache_hits_total") - before
    assert hits > 0, "round 2 found no prefix hit"
    record(check_row("Granite-4.0-H (Mamba2 hybrid): prefix cache, round 1", want, first,
                     FP32_LOGPROB_TOL, decode),
           check_row("Granite-4.0-H (Mamba2 hybrid): prefix cache on state checkpoints, "
                     "round 2", want, again, FP32_LOGPROB_TOL, decode,
                     notes=f"{hits:.0f} prompt tokens from hits (state restored)"))
