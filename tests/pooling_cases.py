"""Tiny random pooling models for the tests: BERT encoders, a cross-encoder, and the
sentence-transformers files that choose their pooling, each saved as an HF folder.

The WordPiece vocabulary is small and written here (lowercase letters, digits, a few
words), so the folders need nothing from the network; weights are seeded and drawn
with a wide range so every layer visibly changes the output.
"""

from __future__ import annotations

import json
import pathlib
import string

import torch

WORDS = ["the", "cat", "dog", "sat", "on", "mat", "a", "is", "what", "capital", "of",
         "france", "paris", "berlin", "fish", "swims", "sky", "blue", "hello", "world"]
VOCAB = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + list(string.ascii_lowercase)
         + list(string.digits) + [f"##{c}" for c in string.ascii_lowercase + string.digits]
         + list(".,?!'-"))
SENTENCES = ["the cat sat on the mat", "what is the capital of france?", "paris",
             "a dog swims", "hello world, the sky is blue!", "berlin 42", "fish"]


def bert_config(num_labels: int | None = None, **overrides):
    from transformers import BertConfig

    values = dict(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                  type_vocab_size=2, initializer_range=0.2)
    if num_labels is not None:
        values["num_labels"] = num_labels
    values.update(overrides)
    return BertConfig(**values)


def save_tokenizer(out: pathlib.Path) -> None:
    from transformers import BertTokenizer

    BertTokenizer(vocab={token: i for i, token in enumerate(VOCAB)},
                  do_lower_case=True).save_pretrained(out)


def build_bert(out: pathlib.Path, classifier: bool = False, num_labels: int = 1,
               seed: int = 0, **overrides) -> pathlib.Path:
    """A tiny random BertModel (or BertForSequenceClassification) folder with a tokenizer."""
    from transformers import BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    if classifier:
        model = BertForSequenceClassification(bert_config(num_labels, **overrides))
    else:
        model = BertModel(bert_config(**overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("LayerNorm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_tokenizer(out)
    return out


def add_sentence_transformers(out: pathlib.Path, pooling: str, normalize: bool,
                              max_seq_length: int | None = None) -> pathlib.Path:
    """sentence-transformers' modules.json + 1_Pooling/config.json (+ Normalize)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    (out / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    modes = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
             "lasttoken": "pooling_mode_lasttoken"}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, **{key: mode == pooling for mode, key in modes.items()}}))
    if max_seq_length is not None:
        (out / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": max_seq_length, "do_lower_case": False}))
    return out


def hf_bert_hidden(model_dir, texts: list[str]) -> list[torch.Tensor]:
    """Each text's last hidden states [L, H] from transformers' BertModel (fp32)."""
    from transformers import AutoTokenizer, BertModel

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertModel.from_pretrained(model_dir, add_pooling_layer=False).eval()
    with torch.no_grad():
        return [model(**tokenizer(t, return_tensors="pt")).last_hidden_state[0] for t in texts]


def hf_cross_encoder_logits(model_dir, pairs: list[tuple[str, str]]) -> torch.Tensor:
    """transformers' BertForSequenceClassification logits [N, num_labels] of text pairs."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = BertForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.cat([model(**tokenizer(a, b, return_tensors="pt")).logits for a, b in pairs])


def cosine_distance(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return 1.0 - float(torch.nn.functional.cosine_similarity(a, b, dim=0))
