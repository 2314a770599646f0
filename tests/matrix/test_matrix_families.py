"""The differential matrix on the model families whose KV cache is not Llama's (issue 30):
DeepSeek-V3's multi-head latent attention caches one latent per token, not keys and
values. Each family's served paths (plain, 16-token prefill chunks, a KV pool small
enough to preempt, TP=2) answer the matrix's request set exactly as the offline float32
engine does on the same weights (the same token ids, logprobs within 1e-4).

P/D and the prefix pull are not rows here: moving latent blocks is refused by name
(test_deepseek.py). `make test-matrix` runs these rows (PAGODA_MATRIX=full).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from clusters import SMALL_POOL_BLOCKS, served
from compare import FP32_LOGPROB_TOL
from request_set import REQUESTS
from rows import ROWS, check_row
from served import send_all
from serve_cluster import wait_until

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


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, smollm2_tokenizer):
    """(model dir, its offline fp32 answers, decode)."""
    from reference import reference_answers, reference_llm  # lazy: loads the engine

    model = _tiny_deepseek_v3(tmp_path_factory.mktemp("tiny_deepseek_v3"), smollm2_tokenizer)
    llm = reference_llm(model)
    tokenizer = llm.get_tokenizer()
    answers = reference_answers(llm, REQUESTS)
    del llm
    return model, answers, lambda ids: tokenizer.decode(ids)


def metric(serve, name: str) -> float:
    return sum(v for (n, _), v in serve.scrape().items() if n == name)


def record(row) -> None:
    ROWS.append(row)
    assert not row.failures, "\n".join(row.failures)


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


def test_deepseek_preempting(deepseek):
    """A pool of SMALL_POOL_BLOCKS latent blocks under the whole set at once: requests
    are preempted and recomputed, and still give the reference's answers."""
    model, want, decode = deepseek
    with served(model, "--max-num-batched-tokens", "64", "--num-gpu-blocks-override",
                str(SMALL_POOL_BLOCKS)) as serve:
        before = metric(serve, "vllm:num_preemptions_total")
        rounds = []
        for _ in range(4):  # until one round overlaps enough to preempt
            rounds.append(send_all(serve.url, REQUESTS, concurrent=True))
            if wait_until(lambda: metric(serve, "vllm:num_preemptions_total") > before, 2):
                break
        preempted = metric(serve, "vllm:num_preemptions_total") - before
    assert preempted > 0, f"the small KV pool preempted nothing in {len(rounds)} rounds"
    rows = [check_row(f"DeepSeek-V3 (MLA): KV pool of {SMALL_POOL_BLOCKS} blocks, "
                      "preempting", want, got, FP32_LOGPROB_TOL, decode,
                      notes=f"{preempted:.0f} preemptions in {len(rounds)} round(s)")
            for got in rounds]
    row = rows[-1]  # one row: a round's failure shows in it
    row.failures = [line for r in rows for line in r.failures]
    for r in rows[:-1]:
        row.cells.update({c: v for c, v in r.cells.items() if v != "ok"})
    record(row)
