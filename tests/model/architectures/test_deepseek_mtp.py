"""MTP speculation on DeepSeek-V3 (`{"method": "mtp"}`, vLLM's `deepseek_mtp`): the
checkpoint's multi-token-prediction layer drafts, the target verifies.

On a tiny random DeepSeek-V3 with an MTP layer added to its checkpoint (transformers
ignores those tensors):
- greedy tokens equal decoding without speculation, with k = 1 and k = 3;
- every draft the worker proposes equals an independent reference: the MTP formula
  written here in torch around transformers' own DeepSeek-V3 decoder layer (loaded
  from the same checkpoint tensors), fed transformers' pre-norm hidden states;
- a "near-bigram" checkpoint, whose MTP layer predicts nearly what the target does,
  makes drafts accepted and rejected both, so acceptance and rollback are exercised;
  it also leaves out the MTP layer's embed_tokens and shared_head.head (the model's
  are used);
- the spec-decode counters (vLLM's names) count MTP drafts.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_deepseek import v3_config
from transformers import AutoModelForCausalLM

from arch_parity import VOCAB_SIZE, save_tiny_checkpoint
from pagoda import LLM, SamplingParams
from pagoda.spec_decode import mtp as mtp_module

N = 3  # num_hidden_layers: the MTP layer is model.layers.3
MAX_TOKENS = 24
PROMPTS = [[int(t) for t in torch.randint(3, VOCAB_SIZE, (n,), generator=torch.Generator()
                                          .manual_seed(n))] for n in (5, 21, 37)]


def add_mtp_layer(path: str, near_bigram: bool = False) -> None:
    """Write model.layers.3.* into the checkpoint: a decoder layer of its own (random,
    or layer 2's) plus enorm, hnorm, eh_proj, shared_head and embed_tokens.

    near_bigram: the target's attention and MLP outputs are scaled down (o_proj and
    down_proj by 0.01), so its next token depends mostly on the current token; the MTP
    layer reads the embedding of the token after its position (eh_proj = [I | 0.05 R]),
    has its blocks scaled down likewise and the target's final norm and head, so it
    predicts mostly what the target will: drafts are accepted often, not always. Its
    embed_tokens and shared_head.head are left out (the model's are used)."""
    tensors = load_file(f"{path}/model.safetensors")
    g = torch.Generator().manual_seed(7)

    def rand(*shape, scale=0.2):
        return scale * torch.randn(*shape, generator=g)

    mtp = {}
    for name, t in tensors.items():
        if name.startswith(f"model.layers.{N - 1}."):
            own = name.replace(f"model.layers.{N - 1}.", f"model.layers.{N}.")
            if near_bigram:
                mtp[own] = t.clone()
            elif "norm" in name:
                mtp[own] = 1.0 + rand(*t.shape)
            elif "correction_bias" in name:
                mtp[own] = rand(*t.shape, scale=0.3)
            else:
                mtp[own] = rand(*t.shape)
    hidden = tensors["model.norm.weight"].shape[0]
    if near_bigram:
        for name in list(tensors) + list(mtp):
            table = tensors if name in tensors else mtp
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                table[name] = 0.01 * table[name]
        mtp[f"model.layers.{N}.enorm.weight"] = torch.ones(hidden)
        mtp[f"model.layers.{N}.hnorm.weight"] = torch.ones(hidden)
        mtp[f"model.layers.{N}.eh_proj.weight"] = torch.cat(
            [torch.eye(hidden), rand(hidden, hidden, scale=0.05)], dim=1)
        mtp[f"model.layers.{N}.shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    else:
        for part in ("enorm", "hnorm", "shared_head.norm"):
            mtp[f"model.layers.{N}.{part}.weight"] = 1.0 + rand(hidden)
        mtp[f"model.layers.{N}.eh_proj.weight"] = rand(hidden, 2 * hidden)
        mtp[f"model.layers.{N}.shared_head.head.weight"] = rand(VOCAB_SIZE, hidden)
        mtp[f"model.layers.{N}.embed_tokens.weight"] = rand(VOCAB_SIZE, hidden)
    save_file({**tensors, **mtp}, f"{path}/model.safetensors", metadata={"format": "pt"})


class ReferenceMTP:
    """The MTP formula in torch: transformers' DeepSeek-V3 gives the target's pre-norm
    hidden states (its final norm's input) and, built with 4 layers from the same
    checkpoint, layer 3 = the MTP layer's decoder block; the rest is read here from the
    checkpoint's tensors."""

    def __init__(self, path: str) -> None:
        self.target = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
        four = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager",
            num_hidden_layers=N + 1).eval()
        self.block, self.rotary = four.model.layers[N], four.model.rotary_emb
        t = load_file(f"{path}/model.safetensors")
        p = f"model.layers.{N}."
        self.embed = t.get(p + "embed_tokens.weight", t["model.embed_tokens.weight"])
        self.head = t.get(p + "shared_head.head.weight", t.get("lm_head.weight"))
        self.enorm, self.hnorm = t[p + "enorm.weight"], t[p + "hnorm.weight"]
        self.eh_proj, self.head_norm = t[p + "eh_proj.weight"], t[p + "shared_head.norm.weight"]
        self.eps = self.target.config.rms_norm_eps

    def rms(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @torch.no_grad()
    def pre_norm_hidden(self, tokens: list[int]) -> torch.Tensor:
        captured = {}

        def keep_input(module, args, out):
            captured["h"] = args[0][0]

        hook = self.target.model.norm.register_forward_hook(keep_input)
        self.target(torch.tensor([tokens]))
        hook.remove()
        return captured["h"]

    @torch.no_grad()
    def layer(self, next_tokens: list[int], previous: torch.Tensor) -> torch.Tensor:
        """MTP outputs at positions 0..T-1 (causal): [T, hidden]."""
        n = len(next_tokens)
        positions = torch.arange(n)
        e = self.embed[torch.tensor(next_tokens)]
        e[positions == 0] = 0
        x = torch.cat([self.rms(e, self.enorm), self.rms(previous, self.hnorm)], -1)
        x = x @ self.eh_proj.T
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        cos_sin = self.rotary(x[None], positions[None])
        out = self.block(x[None], attention_mask=mask, position_ids=positions[None],
                         position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        return out[0]

    def logits_argmax(self, h: torch.Tensor) -> int:
        return int((self.rms(h, self.head_norm) @ self.head.T).argmax())

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k drafts after `tokens` (the last one not yet computed by the target)."""
        h = self.pre_norm_hidden(tokens[:-1])
        inputs, previous = list(tokens[1:]), h
        out = self.layer(inputs, previous)
        drafts = [self.logits_argmax(out[-1])]
        for _ in range(k - 1):
            inputs.append(drafts[-1])
            previous = torch.cat([previous, out[-1:]])
            out = self.layer(inputs, previous)
            drafts.append(self.logits_argmax(out[-1]))
        return drafts


@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory, smollm2_tokenizer):
    paths = {}
    for kind in ("random", "near_bigram"):
        path = save_tiny_checkpoint(tmp_path_factory.mktemp(kind),
                                    v3_config(num_nextn_predict_layers=1), smollm2_tokenizer)
        add_mtp_layer(path, near_bigram=kind == "near_bigram")
        paths[kind] = path
    return paths


def generate(path: str, speculative_config=None, **engine):
    llm = LLM(model=path, dtype="float32", block_size=4, max_model_len=128, seed=0,
              speculative_config=speculative_config, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [list(o.outputs[0].token_ids) for o in outputs]


def recorded_proposals(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, the drafts the MTP layer proposed after them) per proposal."""
    seen = []
    propose = mtp_module.MTPProposer.propose

    def record(self, inputs, sampled, states, wanted):
        drafts = propose(self, inputs, sampled, states, wanted)
        seen.extend((list(states[r].token_ids), d) for r, d in drafts.items())
        return drafts

    monkeypatch.setattr(mtp_module.MTPProposer, "propose", record)
    return seen


_PLAIN: dict[str, list[list[int]]] = {}


def plain_outputs(path: str) -> list[list[int]]:
    """Greedy tokens without speculation (once per checkpoint)."""
    if path not in _PLAIN:
        _PLAIN[path] = generate(path)[1]
    return _PLAIN[path]


# make test runs the near-bigram row (drafts accepted and rejected, the MTP layer reused
# for drafts 2 and 3); the random rows (every draft rejected) are extended.
@pytest.mark.parametrize("kind,k", [
    pytest.param("random", 1, marks=pytest.mark.extended),
    pytest.param("random", 3, marks=pytest.mark.extended),
    ("near_bigram", 3)])
def test_mtp_greedy_equals_plain_and_drafts_equal_the_reference(mtp_checkpoints, monkeypatch,
                                                                 kind, k):
    path = mtp_checkpoints[kind]
    plain = plain_outputs(path)
    proposals = recorded_proposals(monkeypatch)
    # No prefix caching: an MTP entry cached at a block's last position was computed with
    # the token after it, which another request may not share (only acceptance drops).
    llm, spec = generate(path, {"method": "mtp", "num_speculative_tokens": k},
                         enable_prefix_caching=False)
    assert spec == plain
    stats = llm.llm_engine.core.get_stats().spec_decoding
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    reference = ReferenceMTP(path)
    assert proposals
    for tokens, drafts in proposals:
        assert drafts == reference.drafts(tokens, k)[:len(drafts)], tokens
    print(f"{kind} k={k}: {stats.num_accepted_tokens}/{stats.num_draft_tokens} drafts "
          f"accepted, per position {stats.accepted_per_pos}")
    if kind == "random":
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    else:  # accepted and rejected both
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert stats.accepted_per_pos[1] > 0  # a second draft (the MTP layer reused) accepted


def test_mtp_with_chunked_prefill_and_prefix_caching(mtp_checkpoints, monkeypatch):
    """8-token prefill chunks (the token after a chunk's last row is the next prompt
    token): the same greedy tokens, and drafts equal the reference; then the same
    prompts again from prefix-cache hits: the same greedy tokens. (The random checkpoint:
    its drafts depend on every MTP cache entry, the near-bigram one's hardly.)"""
    path = mtp_checkpoints["random"]
    plain = plain_outputs(path)
    proposals = recorded_proposals(monkeypatch)
    llm, spec = generate(path, {"method": "deepseek_mtp"}, max_num_batched_tokens=8)
    assert spec == plain
    assert llm.llm_engine.core.get_stats().spec_decoding.num_spec_tokens == 1  # the default
    reference = ReferenceMTP(path)
    for tokens, drafts in proposals:
        assert drafts == reference.drafts(tokens, 1), tokens
    again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == plain
    assert llm.llm_engine.core.get_stats().prefix_cache_hits > 0
